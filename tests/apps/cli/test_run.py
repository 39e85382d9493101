"""``veloxquant generate`` and ``demo`` (`veloxquant_mlx.apps.cli.run`): answers streamed from the compressed caches
with attention on their codes, the demo's table and JSON, prompts read from a file."""
from __future__ import annotations

import json

import pytest

from veloxquant_mlx.apps.cli import main
from veloxquant_mlx.apps.cli import run as run_mod
from veloxquant_mlx.apps.cli.common import CLIError
from _cli_helpers import _one_line_error


@pytest.mark.model
@pytest.mark.parametrize("preset", ["tq-affine-k8v8", "tq-mse-k4v4"])
def test_generate_streams_answer(smollm2, capsys, attention_on_codes, preset):
    rc = main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8", "--preset", preset])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out
    # the registered compressed cache answered with attention on its codes, in every layer at every step
    assert attention_on_codes["attend_packed"] >= len(smollm2[0].layers) * 8


# KL to the plain cache of `veloxquant demo --context 96` on SmolLM2, measured: tq-affine-k8v8 3.7e-5,
# tq-mse-k4v4 0.0179 (tq-mse-k3v3: 0.070 at context 64). Bound: 2x the measured KL.
DEMO_KL = {"tq-affine-k8v8": 3.7e-5, "tq-mse-k4v4": 0.0179}


@pytest.mark.model
def test_demo_small(smollm2, capsys, tmp_path, attention_on_codes):
    out = tmp_path / "demo.json"
    # context 96: past the 4 sink tokens, the 8-token trim headroom and one 64-token key block, so the
    # affine_block configuration really codes tokens (at 64 it would hold them all exact)
    rc = main(["demo", "--context", "96", "--max-tokens", "4", "--presets", "kv," + ",".join(DEMO_KL),
               "--no-progress", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "tq-mse-k4v4" in text and "Δppl" in text
    data = json.loads(out.read_text())
    methods = data["presets"]
    assert set(methods) == {"kv", *DEMO_KL}
    assert methods["kv"]["ppl"]["delta_ppl"] == 0.0 and methods["kv"]["ppl"]["kl"] == 0.0
    for name, measured in DEMO_KL.items():
        assert 0.0 <= methods[name]["ppl"]["kl"] < 2 * measured, (name, methods[name]["ppl"]["kl"])
        assert methods[name]["ppl"]["memory"]["bits_per_coordinate"] < methods["kv"]["ppl"]["memory"]["bits_per_coordinate"] / 3
    # the near-lossless 8-bit cache answers exactly as the plain cache does
    assert methods["tq-affine-k8v8"]["answer"] == methods["kv"]["answer"]
    assert attention_on_codes["attend_packed"] >= 2 * len(smollm2[0].layers) * 4


def test_prompts_file_one_prompt_a_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("What is the capital of France?\n\n  And of Japan?  \n", encoding="utf-8")
    assert run_mod._read_prompts(str(path)) == ["What is the capital of France?", "And of Japan?"]
    (tmp_path / "blank.txt").write_text("\n   \n", encoding="utf-8")
    with pytest.raises(CLIError, match=r"--prompts-file '.*blank\.txt' holds no prompt \(one per line\)"):
        run_mod._read_prompts(str(tmp_path / "blank.txt"))
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    with pytest.raises(CLIError, match=r"--prompts-file '.*latin1\.txt' cannot be read"):
        run_mod._read_prompts(str(tmp_path / "latin1.txt"))
    with pytest.raises(CLIError, match="cannot be read"):
        run_mod._read_prompts(str(tmp_path / "missing.txt"))


def test_an_unreadable_prompts_file_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    def no_load(args):
        raise AssertionError("the model was loaded before --prompts-file was read")

    monkeypatch.setattr(run_mod, "_load", no_load)
    rc = main(["generate", "--prompts-file", str(tmp_path / "missing.txt")])
    line = _one_line_error(capsys.readouterr().err)
    assert rc == 1 and "--prompts-file" in line and "missing.txt" in line, line
