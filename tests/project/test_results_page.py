"""scripts/results_page.py: the results page, its SVG plots and the README's table, from benchmark JSONs.

Small synthetic JSONs in the layout the commands write (``veloxquant demo --out``, benchmarks/quality.py,
benchmarks/e2e_speed.py, benchmarks/memory.py) go into a temporary results folder; the generator runs as a user
runs it (``python scripts/results_page.py --results DIR --docs DIR --readme FILE``) and every figure it writes must
be one of the JSONs'. A folder without a JSON gives a page naming the command that makes each one.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from veloxquant_mlx.cache.presets import BUDGETS, DEFAULT_NAME

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "results_page.py"


def _ppl(ppl, delta, kl, bits, mib):
    return {"ppl": ppl, "delta_ppl": delta, "kl": kl, "top1": 0.99, "windows": 1,
            "memory": {"bits_per_coordinate": bits, "mib_total": mib}}


DEMO = {"prompt": "What is the capital of France?", "context": 513, "attention_path": "pure-MLX (test)",
        "presets": {
            "kv": {"ppl": _ppl(21.5, 0.0, 0.0, 47.91, 33.75), "decode_tokens_per_s": 13.1, "answer": "Paris."},
            "mlx-q8": {"ppl": _ppl(21.6, 0.1, 0.00031, 13.47, 9.49), "decode_tokens_per_s": 12.2, "answer": "Paris."},
            "mlx-q4": {"ppl": _ppl(25.4, 3.9, 0.1421, 7.49, 5.27), "decode_tokens_per_s": 11.7, "answer": "La"},
            "mlx-q2": {"ppl": _ppl(975.0, 953.5, 3.5781, 4.49, 3.16), "decode_tokens_per_s": 12.0, "answer": "You"},
            DEFAULT_NAME: {"ppl": _ppl(21.52, 0.02, 0.00361, 9.79, 6.9), "decode_tokens_per_s": 13.9,
                           "answer": "The capital of France is Paris."},
            "tq-4b": {"ppl": _ppl(21.57, 0.07, 0.01203, 4.24, 2.99), "decode_tokens_per_s": 14.4,
                      "answer": "The capital | of France is Paris."},
        }}
QUALITY = {"model": "smollm2", "command": "benchmarks/quality.py --contexts 2048,4096", "configs": {},
           "bits": {"kv": {"bits": {"2048": 32.0, "4096": 32.0}}, "tq-4b": {"bits": {"2048": 4.14, "4096": 4.13}},
                    "mlx-q8": {"bits": {"2048": 9.0}}},
           "corpora": {c: {"tokens": 99999, "ppl": {
               "2048": {"kv": _ppl(20.0, 0.0, 0.0, 32.0, 1.0), "mlx-q8": _ppl(20.0, 0.0, kl8, 9.0, 1.0),
                        DEFAULT_NAME: _ppl(20.1, 0.1, kld, 7.31, 1.0), "tq-4b": _ppl(20.2, 0.2, kl4, 4.31, 0.2)},
               "4096": {"kv": _ppl(19.0, 0.0, 0.0, 32.0, 1.0), "tq-4b": _ppl(19.2, 0.2, kl4 / 2, 4.29, 0.2)}}}
               for c, kl8, kld, kl4 in (("debian-reference", 0.0003, 0.0033, 0.0111), ("kjv", 0.0004, 0.0174, 0.0395))},
           "needle": {"corpus": "debian-reference", "lengths": [1024], "depths": [0.1, 0.5, 0.9],
                      "results": {"tq-4b": {"passed": 3, "total": 3}}}}
E2E = {"model": "smollm2", "prompt": 4096, "chunk": 512, "decode": 64, "fill": "prefill", "repeats": 3,
       "machine": "test CPU, 2 cores", "blas": "OpenBLAS", "attention_path": "compiled kernel (test)",
       "rows": [{"config": "kv", "prefill_tok_s": 900.0, "prefill_vs_kv": 1.0, "peak_mib": 700.0, "cache_mib": 96.0,
                 "decode_step_tok_s": 10.0, "decode_step_vs_kv": 1.0},
                {"config": "mlx-q4", "prefill_tok_s": 800.0, "prefill_vs_kv": 0.889, "peak_mib": 650.0,
                 "cache_mib": 30.0, "decode_step_tok_s": 9.0, "decode_step_vs_kv": 0.9},
                {"config": DEFAULT_NAME, "prefill_tok_s": 1100.0, "prefill_vs_kv": 1.222, "peak_mib": 620.0,
                 "cache_mib": 19.5, "decode_step_tok_s": 12.7, "decode_step_vs_kv": 1.27}]}
MEMORY = {"model": "smollm2", "prompt": 4096, "decode": 100, "weights_bytes": 2**20 * 100,
          "caches": {"kv": {"peak_mib": 812.5, "cache_mib": 96.0, "seconds": 30.0}}}
GEMMA_Q = {"model": "gemma3-270m", "command": "benchmarks/quality.py --model gemma3-270m", "configs": {},
           "bits": {"kv": {"bits": {"2048": 12.0, "8192": 7.0}}, "mlx-q8": {"bits": {"2048": 9.0, "8192": 9.0}},
                    DEFAULT_NAME: {"bits": {"2048": 3.88, "8192": 1.78}}, "tq-4b": {"bits": {"2048": 2.39}}},
           "corpora": {c: {"tokens": 5000, "ppl": {
               "2048": {"kv": _ppl(16.0, 0.0, 0.0, 12.0, 1.0), "mlx-q8": _ppl(16.1, 0.1, kl8, 9.0, 1.0),
                        DEFAULT_NAME: _ppl(16.0, 0.0, kld, 3.88, 1.0), "tq-4b": _ppl(17.0, 1.0, kl4, 2.39, 1.0)},
               "8192": {"kv": _ppl(15.0, 0.0, 0.0, 7.0, 1.0), DEFAULT_NAME: _ppl(15.0, 0.0, kld / 2, 1.78, 1.0)}}}
               for c, kl8, kld, kl4 in (("debian-reference", 0.0010, 0.0006, 0.0533), ("kjv", 0.0061, 0.0053, 0.334))},
           "needle": None}


def _lc(nbytes, prefill, decode, ratio=None):
    r = {"cache_bytes": nbytes, "bits": 8 * nbytes / (18 * 2 * 256 * 32868), "prefill_s": prefill,
         "decode_tok_s": decode, "peak_mlx_bytes": 2**20 * 900, "peak_process_bytes": 2**20 * 2500}
    if ratio:
        r["decode_x_plain"] = ratio
    return r


LONG = {"model": "gemma3-270m", "machine": "test CPU, 2 cores", "environment": "MLX test", "decode": 100,
        "prefill_step": 2048, "configs": ["plain", "default", "tq-4b"], "command": "benchmarks/long_context.py",
        "runs": [{"length": 32768, "weights_bytes": 2**20 * 1023, "model_rss_bytes": 2**20 * 1512, "configs": {
            "plain": _lc(2**20 * 200, 900.0, 3.0), "default": _lc(2**20 * 40, 850.0, 3.6, [1.2, 1.15, 1.25]),
            "tq-4b": _lc(2**20 * 25, 880.0, 3.7, [1.23, 1.2, 1.26])}}]}
README = """# title

intro

<!-- results:begin -->
old table
<!-- results:end -->

rest
"""


def run(results: Path, docs: Path, readme: Path):
    return subprocess.run([sys.executable, str(SCRIPT), "--results", str(results), "--docs", str(docs),
                           "--readme", str(readme)], capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.fixture
def folders(tmp_path):
    results, docs, readme = tmp_path / "results", tmp_path / "docs", tmp_path / "README.md"
    results.mkdir()
    readme.write_text(README, encoding="utf-8")
    return results, docs, readme


def write(results: Path, **files):
    for name, data in files.items():
        (results / f"{name}.json").write_text(json.dumps(data), encoding="utf-8")


def test_page_plots_and_readme_from_every_json(folders):
    results, docs, readme = folders
    write(results, demo=DEMO, quality=QUALITY, e2e_speed=E2E, memory=MEMORY, quality_gemma=GEMMA_Q, long_context=LONG,
          attention_row_plans={"x": 1})
    (results / "broken.json").write_text("{not json", encoding="utf-8")
    done = run(results, docs, readme)
    assert done.returncode == 0, done.stderr
    assert "skipped" in done.stderr and "broken.json" in done.stderr

    page = (docs / "results.md").read_text(encoding="utf-8")
    assert "Not measured here yet" not in page
    # the demo table: every method, figures as the JSON has them
    for name, r in DEMO["presets"].items():
        p = r["ppl"]
        row = next(line for line in page.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {p['memory']['bits_per_coordinate']:.2f} | {p['memory']['mib_total']:.2f} |" in row
        assert f"| {p['kl']:.4f} |" in row and f"| {r['decode_tokens_per_s']:.1f} |" in row
    assert "The capital \\| of France is Paris." in page  # a | in an answer does not break the table
    assert "| tq-4b | 4.31 | +0.200 | 0.0111 | 4.29 | +0.200 | 0.0056 |" in page and "tq-4b 3/3" in page  # quality
    assert "| " + DEFAULT_NAME + " | 12.70 | 1.27 | 1.22 | 620.0 | 19.50 |" in page  # e2e_speed.json
    assert "| kv | 812.5 | 96.00 | 30.0 |" in page  # memory.json
    assert "`results/attention_row_plans.json`" in page  # other JSONs are named, not dropped

    # the plots: well-formed SVG, one marker per method (the plain cache is the KL reference: not plotted)
    svg = ET.parse(docs / "results-kl-bits.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert len(svg.findall(f"{ns}circle")) == 2 and len(svg.findall(f"{ns}rect")) == 1 + 3  # background + mlx-q*
    labels = [t.text for t in svg.iter(f"{ns}text")]
    assert set(DEMO["presets"]) - {"kv"} <= set(labels)
    width, height = float(svg.get("width")), float(svg.get("height"))
    for el in svg.iter():  # every mark and label inside the picture
        for ax, limit in (("x", width), ("cx", width), ("y", height), ("cy", height)):
            if el.get(ax) is not None:
                assert 0 <= float(el.get(ax)) <= limit, (el.tag, el.attrib, el.text)
    # each point sits where its figures put it: higher KL is higher up, more bits further right
    marks = {t.text: (float(t.get("x")), float(t.get("y"))) for t in svg.iter(f"{ns}text") if t.get("fill")}
    assert marks["mlx-q8"][0] > marks[DEFAULT_NAME][0] > marks["mlx-q4"][0] > marks["tq-4b"][0]
    assert marks["mlx-q2"][1] < marks["mlx-q4"][1] < marks["tq-4b"][1] < marks[DEFAULT_NAME][1]
    bars = ET.parse(docs / "results-speed.svg").getroot()
    assert "1.27x" in [t.text for t in bars.iter(f"{ns}text")]
    assert "![KL against bits per coordinate](results-kl-bits.svg)" in page
    # each quality JSON: one KL-against-bits panel per corpus and context (the plain cache, the reference, left out)
    grid = ET.parse(docs / "results-kl-bits-quality_gemma.svg").getroot()
    panels = grid.findall(f"{ns}svg")
    assert len(panels) == 4 and float(grid.get("width")) == 2 * float(panels[0].get("width"))
    titles = [p.findall(f"{ns}text")[0].text for p in panels]
    assert titles == ["Gemma 3 270M, Debian, 2048 tokens", "Gemma 3 270M, Debian, 8192 tokens",
                      "Gemma 3 270M, Bible, 2048 tokens", "Gemma 3 270M, Bible, 8192 tokens"]
    first = panels[0]  # 2048 tokens: mlx-q8 a square, the default and tq-4b circles, no kv
    assert len(first.findall(f"{ns}circle")) == 2 and len(first.findall(f"{ns}rect")) == 1 + 1
    assert {t.text for t in first.iter(f"{ns}text") if t.get("fill")} == {"mlx-q8", DEFAULT_NAME, "tq-4b"}
    assert len(panels[1].findall(f"{ns}circle")) == 1  # 8192: the default alone
    assert "![KL against bits per corpus and context](results-kl-bits-quality_gemma.svg)" in page
    assert "![KL against bits per corpus and context](results-kl-bits-quality.svg)" in page

    # the README: only the block between the markers changes; its first table is quality.json's (issue 54's
    # picture): rows plain, mlx-q8, (mlx-q4 absent), default, budgets present; bits and KL per corpus and context
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("# title\n\nintro\n\n<!-- results:begin -->") and text.endswith("<!-- results:end -->\n\nrest\n")
    assert "old table" not in text and "mlx-q2" not in text
    smollm2 = text[: text.index("Gemma 3 270M")]
    head = next(line for line in smollm2.splitlines() if line.startswith("| cache"))
    assert head == ("| cache | bits @2048 | bits @4096 | KL Debian @2048 | KL Debian @4096 | KL Bible @2048 | "
                    "KL Bible @4096 | passkey | decode x plain @4096 |")
    rows = {line.split(" | ")[0]: line for line in smollm2.splitlines()
            if line.startswith("| ") and not line.startswith("| cache")}
    assert list(rows) == ["| mlx_lm plain", "| mlx_lm 8-bit", f"| `{DEFAULT_NAME}` (default)", "| `tq-4b`"]
    assert [b for b in BUDGETS if b != "tq-4b"] and not any(b in text for b in BUDGETS if b != "tq-4b")
    assert rows["| `tq-4b`"] == "| `tq-4b` | 4.14 | 4.13 | 0.0111 | 0.0056 | 0.0395 | 0.0198 | 3/3 | not measured |"
    # bits: measure_bits at the length where the run has them, else the evaluated cache's; a context not run: -
    assert rows[f"| `{DEFAULT_NAME}` (default)"] == (
        f"| `{DEFAULT_NAME}` (default) | 7.31 | - | 0.0033 | - | 0.0174 | - | - | 1.27x |")
    assert rows["| mlx_lm 8-bit"].startswith("| mlx_lm 8-bit | 9.00 | - | 0.0003 |")
    assert "python scripts/results_page.py" in text and "docs/results-kl-bits-quality.svg" in text
    assert "Passkey: retrieved / cases (prompts of 1024 tokens, the key at 10 / 50 / 90 % depth, Debian filler)" in text
    # the second model's table: KL per corpus and length, bits, and the longest context's bytes and ratios
    gemma = text[text.index("Gemma 3 270M"):]
    head = next(line for line in gemma.splitlines() if line.startswith("| cache"))
    assert head == ("| cache | bits @2048 | bits @8192 | KL Debian @2048 | KL Debian @8192 | KL Bible @2048 | "
                    "KL Bible @8192 | KV MiB @32768 | decode x plain @32768 | prefill x plain @32768 |")
    g = {line.split(" | ")[0]: line for line in gemma.splitlines() if line.startswith("| ") and "cache" not in line}
    assert g["| mlx_lm plain"].endswith("| 12.00 | 7.00 | 0.0000 | 0.0000 | 0.0000 | 0.0000 | 200.0 | 1.00 | 1.00 |")
    assert g[f"| `{DEFAULT_NAME}` (default)"].endswith(
        "| 3.88 | 1.78 | 0.0006 | 0.0003 | 0.0053 | 0.0027 | 40.0 | 1.20 | 1.06 |")
    assert g["| mlx_lm 8-bit"].endswith("| 9.00 | 9.00 | 0.0010 | - | 0.0061 | - | - | - | - |")
    assert g["| `tq-4b`"].endswith("| 2.39 | - | 0.0533 | - | 0.3340 | - | 25.0 | 1.23 | 1.02 |")
    # the page: the second model's quality section and the long-context table
    assert "## Quality per corpus and context, Gemma 3 270M (`results/quality_gemma.json`" in page
    assert "| default | 40.00 | 0.200 |" in page and "| 2500 | 900.0 | 850.0 | 1.06 | 3.60 | 1.20 [1.15, 1.25] |" in page

    # a second run changes nothing (the page is a function of the JSONs)
    before = {p.name: p.read_bytes() for p in docs.iterdir()}, readme.read_bytes()
    assert run(results, docs, readme).returncode == 0
    assert ({p.name: p.read_bytes() for p in docs.iterdir()}, readme.read_bytes()) == before


def test_missing_jsons_name_their_commands_and_leave_the_readme(folders):
    results, docs, readme = folders
    done = run(results, docs, readme)
    assert done.returncode == 0, done.stderr
    page = (docs / "results.md").read_text(encoding="utf-8")
    for name, command in (("demo", "veloxquant demo --out results/demo.json"),
                          ("quality", "python benchmarks/quality.py"), ("e2e_speed", "python benchmarks/e2e_speed.py"),
                          ("memory", "python benchmarks/memory.py")):
        line = next(line for line in page.splitlines() if f"`results/{name}.json`" in line)
        assert command in line
    assert not list(docs.glob("*.svg"))
    assert readme.read_text(encoding="utf-8") == README  # never replaced by nothing
    assert "left as it is" in done.stderr and "veloxquant demo --out results/demo.json" in done.stderr


def test_without_quality_json_the_readme_table_is_the_demo_s(folders):
    results, docs, readme = folders
    write(results, demo=DEMO, e2e_speed=E2E, quality={**QUALITY, "corpora": {}})  # a quality run without rows
    assert run(results, docs, readme).returncode == 0
    text = readme.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| cache")]
    assert [r.split(" | ")[0] for r in rows] == ["| mlx_lm plain", "| mlx_lm 8-bit", "| mlx_lm 4-bit",
                                                 f"| `{DEFAULT_NAME}` (default)", "| `tq-4b`"]
    assert rows[3].endswith("| 0.0036 | +0.020 | 13.9 | 1.27x |") and rows[1].endswith("| not measured |")
    assert "docs/results-kl-bits.svg" in text


def test_demo_alone_gives_the_table_without_a_speed_column(folders):
    results, docs, readme = folders
    write(results, demo=DEMO)
    assert run(results, docs, readme).returncode == 0
    text = readme.read_text(encoding="utf-8")
    head = next(line for line in text.splitlines() if line.startswith("| cache"))
    assert "decode x plain" not in head and "decode tok/s @513" in head
    page = (docs / "results.md").read_text(encoding="utf-8")
    assert re.search(r"`results/e2e_speed.json` .*: `python benchmarks/e2e_speed.py", page)
    assert (docs / "results-kl-bits.svg").exists() and not (docs / "results-speed.svg").exists()


def test_readme_without_markers_is_an_error(folders):
    results, docs, readme = folders
    write(results, demo=DEMO)
    readme.write_text("# no markers\n", encoding="utf-8")
    done = run(results, docs, readme)
    assert done.returncode != 0 and "markers" in done.stderr
    assert readme.read_text(encoding="utf-8") == "# no markers\n"


def test_a_demo_json_written_before_issue_57_is_read_as_it_was(folders):
    """Demo runs before issue 57 kept their per-preset results under ``methods``; the page reads them the same."""
    results, docs, readme = folders
    old = {k: v for k, v in DEMO.items() if k != "presets"}
    old["methods"] = DEMO["presets"]
    write(results, demo=old)
    assert run(results, docs, readme).returncode == 0
    page_old = (docs / "results.md").read_text(encoding="utf-8")
    write(results, demo=DEMO)
    assert run(results, docs, readme).returncode == 0
    assert (docs / "results.md").read_text(encoding="utf-8") == page_old
    assert "| tq-4b |" in page_old
