"""The tiny configurations (`veloxquant_mlx.apps.eval.tiny_configs`): one per architecture module of the installed
mlx_lm, each a config.json dict its ``ModelArgs.from_dict`` takes and small enough to run in a test; what needs
something else is said (`NEEDS`). Which architectures have one at all: test_architectures.py."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from veloxquant_mlx.apps.eval import tiny_configs
from veloxquant_mlx.apps.eval.tiny_configs import CONFIGS, METAL_ONLY, NEEDS


def test_every_configuration_names_an_mlx_lm_architecture():
    assert len(CONFIGS) >= 100
    missing = [name for name in CONFIGS if importlib.util.find_spec(f"mlx_lm.models.{name}") is None]
    assert not missing, missing
    assert all(isinstance(c, dict) and isinstance(c.get("model_type"), str) for c in CONFIGS.values())
    assert set(METAL_ONLY) <= set(NEEDS) and all(isinstance(why, str) and why for why in NEEDS.values())


def test_the_json_file_holds_one_configuration_a_line():
    path = Path(tiny_configs.__file__).with_name("tiny_configs.json")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and len(lines) == len(CONFIGS) + 2
    assert [line.split('"')[1] for line in lines[1:-1]] == list(CONFIGS)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text", "mixtral", "deepseek_v2"])
def test_a_configuration_builds_a_small_model_of_its_architecture(name):
    module = importlib.import_module(f"mlx_lm.models.{name}")
    config = CONFIGS[name]
    model = module.Model(module.ModelArgs.from_dict(config))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert config["vocab_size"] == 128 and 2 <= len(model.layers) <= 6 and n_params < 1_000_000, (name, n_params)
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 128) and bool(mx.all(mx.isfinite(logits)).item())
