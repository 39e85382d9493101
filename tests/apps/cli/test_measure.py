"""``veloxquant presets``, ``plan``, ``calibrate`` and ``eval`` (`veloxquant_mlx.apps.cli.measure`): the presets
table's measured bytes, the presets a head dim cannot take, the longest context that fits, a calibration measured
then used by ``eval`` and ``generate``."""
from __future__ import annotations

import json

import pytest

from veloxquant_mlx.apps.cli import main
from veloxquant_mlx.apps.cli import measure as measure_mod
from veloxquant_mlx.apps.eval import registered_specs, resolve_spec
from veloxquant_mlx.apps.eval.memory import measure_bytes_per_token
from veloxquant_mlx.cache.presets import DEFAULT_NAME
from _cli_helpers import _deprecation, _lines, _one_line_error


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
    # keys and values per token: b-bit Lloyd-Max codes + one one-byte log-grid scale per 64 coordinates
    **{f"tq-{b}b": 2 * H * (D * b // 8 + D // 64) for b in (4, 3, 2)},
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


def test_presets_command_and_its_deprecated_name_methods(capsys):
    assert main(["presets", "--head-dim", "64"]) == 0
    new = capsys.readouterr()
    assert new.err == "" and new.out.splitlines()[1].split()[0] == "preset"  # the table's heading
    assert main(["methods", "--head-dim", "64"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out and old.err.splitlines() == [_deprecation("`veloxquant methods`", "`veloxquant presets`")]


# --- `veloxquant presets` / `plan` at head dims some presets cannot take -----------------------------------------
@pytest.mark.parametrize("head_dim", [1, 7])
def test_methods_lists_what_a_head_dim_cannot_take(capsys, head_dim):
    from veloxquant_mlx.apps.cli import main

    assert main(["presets", "--head-dim", str(head_dim)]) == 0  # was MLX's "[quantize] ... group size 64"
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()}
    assert "n/a" not in rows["kv"] and "32.000" in rows["kv"]  # what applies is still measured
    for name in ("mlx-q8", "mlx-q4", "mlx-q2"):
        assert f"not applicable at head_dim={head_dim}: needs head_dim a multiple of 64" in rows[name]
    (note,) = _lines(err)  # one line naming the methods and why
    assert f"head_dim={head_dim}" in note and "mlx-q8, mlx-q4, mlx-q2: needs head_dim a multiple of 64" in note
    if head_dim == 1:  # TurboQuant codes need d >= 2
        assert "n/a" in rows["tq-mse-k4v4"] and "tq-mse-k4v4" in note


def test_plan_lists_what_a_head_dim_cannot_take(capsys):
    from veloxquant_mlx.apps.cli import main

    assert main(["plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "7", "--ram-gb", "1"]) == 0
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert rows["mlx-q4"][1:] == ["n/a", "n/a"] and rows["kv"][-1] != "n/a"
    assert "mlx-q4" in _lines(err)[0]


def test_methods_exits_nonzero_only_when_no_method_applies(capsys, monkeypatch):
    import veloxquant_mlx.apps.cli as cli

    only_mlx_q = [s for s in registered_specs() if s.family == "mlx-q"]
    monkeypatch.setattr(cli.measure, "registered_specs", lambda head_dim=None: only_mlx_q)  # (read by `presets`)
    assert cli.main(["presets", "--head-dim", "7"]) == 1
    (line,) = _lines(capsys.readouterr().err)
    assert "--head-dim 7: no preset applies" in line and "multiple of 64" in line


def test_inapplicable_names_why_before_anything_is_built():
    """mlx_lm's quantized caches need whole groups of 64 along the head dim; ours are measured instead (None)."""
    for head_dim in (7, 96):
        assert measure_mod._inapplicable(resolve_spec("mlx-q4"), head_dim) == (
            "needs head_dim a multiple of 64 (mlx_lm QuantizedKVCache group_size)")
    assert measure_mod._inapplicable(resolve_spec("mlx-q4"), 128) is None
    assert measure_mod._inapplicable(resolve_spec("tq-mse-k4v4"), 7) is None
    specs = [resolve_spec(n) for n in ("mlx-q8", "mlx-q2", "tq-4b")]
    assert measure_mod._reasons([(specs[0], "why a"), (specs[1], "why a"), (specs[2], "why b")]) == (
        "mlx-q8, mlx-q2: why a; tq-4b: why b")


def test_plan_longest_context(capsys):
    assert main(["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--ram-gb", "1"]) == 0
    out = capsys.readouterr().out
    row = next(l for l in out.splitlines() if l.startswith("kv "))
    ctx = int(row.split()[-1].replace(",", ""))
    per_token = 30 * 2 * 3 * 64 * 4
    assert ctx == 2**30 // per_token


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
