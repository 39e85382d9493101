"""The ``veloxquant`` command line (`veloxquant_mlx.apps.cli.parser`): bad arguments are one-line usage errors;
``--preset`` / ``--presets`` name presets while the old ``--method`` / ``--methods`` still parse (one deprecation
line); an unknown preset or a bare family is refused while parsing, before any model loads."""
from __future__ import annotations

import re

import pytest

from veloxquant_mlx.apps.cli import main
from veloxquant_mlx.apps.cli.parser import build_parser
from veloxquant_mlx.cache.presets import PRESETS
from _cli_helpers import _deprecation, _one_line, _one_line_error, _stop_at_load


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


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "-1", "0", "x"])
def test_cli_plan_ram_gb_must_be_finite_positive(capsys, value):
    from veloxquant_mlx.apps.cli import main

    rc = main(["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", f"--ram-gb={value}"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and "--ram-gb" in line and "positive number" in line


# --- one word per choice (issue 45, item 4): --preset / --presets / `presets` name presets; the old spellings
# --method / --methods / `methods` still work until DEPRECATED_UNTIL and print one line on stderr naming the new one
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
