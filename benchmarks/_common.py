"""What the benchmark scripts share: the common options of their command lines, the run metadata their JSON records,
writing that JSON, printing tables, and the caches a configuration name stands for.

Two kinds of scripts import it, neither editing ``sys.path`` (``veloxquant_mlx`` comes from the editable install):

- the entry points, ``benchmarks/NAME.py``, run as ``python benchmarks/NAME.py`` from the repository root: the
  script's folder is the first entry of ``sys.path``, so they ``import _common``;
- the research probes, ``benchmarks/probes/NAME.py``, run as ``python -m benchmarks.probes.NAME`` from the
  repository root: ``benchmarks`` is then a package, so they ``from benchmarks import _common``.

This module imports no other script and no MLX at module level (a script re-executes itself with OpenBLAS preloaded,
`veloxquant_mlx.apps.blas.ensure_openblas`, before MLX loads), so it is the same module under either name.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

DEFAULT_MODEL = "smollm2"


# -- command line -----------------------------------------------------------------------------------------------------

def parser(doc: str, brief: bool = False) -> argparse.ArgumentParser:
    """A script's parser: ``--help`` shows its whole docstring as written (``brief``: only its first paragraph)."""
    if brief:
        return argparse.ArgumentParser(description=doc.split("\n\n")[0])
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_model(ap: argparse.ArgumentParser, default: str = DEFAULT_MODEL) -> None:
    """``--model``: what `veloxquant_mlx.apps.models.load_model` loads (default the embedded SmolLM2-135M)."""
    ap.add_argument("--model", default=default, help=f"model for veloxquant_mlx.apps.models.load_model (default {default})")


def add_out(ap: argparse.ArgumentParser, default: Optional[str] = None, help: Optional[str] = None) -> None:
    """``--out PATH``: the JSON the script writes (`write_json`); without a default, none unless given."""
    ap.add_argument("--out", default=default, help=help or (f"JSON written (default {default})" if default
                                                            else "write the results as JSON here"))


def ints(text: str) -> List[int]:
    """``"512,2048"`` -> ``[512, 2048]`` (an argparse type; empty entries are skipped, so ``""`` is ``[]``)."""
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None


def positive_ints(text: str) -> List[int]:
    """`ints`, at least one, every one >= 1 (an argparse type)."""
    out = ints(text)
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


# -- run metadata -----------------------------------------------------------------------------------------------------

def mlx_version() -> str:
    import mlx.core as mx

    return getattr(mx, "__version__", "?")


def blas() -> str:
    """Which BLAS serves MLX in this process (`veloxquant_mlx.apps.blas.loaded_blas`)."""
    from veloxquant_mlx.apps.blas import loaded_blas

    return loaded_blas()


def machine() -> str:
    """The CPU model and core count (what a speed ratio depends on; say it beside every figure)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()}"


def machine_info() -> Dict[str, Any]:
    """The platform, core count, BLAS and MLX version, as one JSON object."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "blas": blas(), "mlx": mlx_version()}


def environment() -> str:
    """One line for a run's header: MLX version and device, BLAS, machine."""
    import mlx.core as mx

    return f"MLX {mlx_version()}, device {mx.default_device()}, BLAS: {blas()}; machine: {machine()}"


# -- output -----------------------------------------------------------------------------------------------------------

def write_json(path, obj, indent: int = 1, default=None, quiet: bool = False, file=None):
    """Write ``obj`` as JSON to ``path`` (its folder made first) and, unless ``quiet``, say so on ``file`` (stdout)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=indent, default=default)
    if not quiet:
        print(f"wrote {path}", file=file or sys.stdout, flush=True)
    return path


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table: the header, its rule, one line per row (cells already formatted, or ``str()`` of them)."""
    lines = ["| " + " | ".join(map(str, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def aligned_table(head: Sequence[str], rows: Sequence[Sequence[Any]], sep: str = "  ") -> str:
    """A plain-text table, every column right-aligned to its widest cell."""
    cells = [list(map(str, head))] + [list(map(str, row)) for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(head))]
    return "\n".join(sep.join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


# -- caches by configuration name (e2e_speed.py, probes/step_profile.py) ---------------------------------------------

def preset_with_options(name: str):
    """``"PRESET+option+key=value"`` -> ``("PRESET", {"option": True, "key": value})`` (ints where they read as
    ints): a preset with some options changed, as one ``--configs`` entry (``tq-4b+rope_offset``)."""
    preset, *changes = name.split("+")
    options = {}
    for change in changes:
        key, eq, value = change.partition("=")
        if not key:
            raise ValueError(f"config {name!r}: an empty option after '+'")
        options[key] = True if not eq else (int(value) if value.lstrip("-").isdigit() else
                                            {"true": True, "false": False}.get(value.lower(), value))
    return preset, options


def registered(name: str):
    """The registered TurboQuant method called ``name`` (its `CacheSpec`), or None."""
    from veloxquant_mlx.apps.eval.specs import compressed_specs

    return next((s for s in compressed_specs() if s.name == name), None)


def make_cache(name: str, model):
    """A fresh cache list for ``model``: a registered method's (as the CLI builds it), ``kv`` (mlx_lm's ``KVCache``)
    or ``mlx-q8`` / ``mlx-q4`` (mlx_lm's ``QuantizedKVCache(group_size=64, bits=8 / 4)``)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    spec = registered(name)
    if spec is not None:
        return spec.make_cache(model)
    if name == "kv":
        return [KVCache() for _ in model.layers]
    if name in ("mlx-q8", "mlx-q4"):
        return [QuantizedKVCache(group_size=64, bits=int(name[-1])) for _ in model.layers]
    raise ValueError(f"unknown configuration {name!r}: kv, mlx-q8, mlx-q4 or a registered TurboQuant method")


def context_for(name: str):
    """What a configuration runs inside: ``use_packed_attention()`` for a registered method, else nothing."""
    from veloxquant_mlx.integration.routing import use_packed_attention

    return use_packed_attention() if registered(name) is not None else contextlib.nullcontext()


def prefill(model, cache, prompt, chunk: int):
    """Feed ``prompt`` (1, L) in chunks; returns the last logits (1, V), evaluated."""
    import mlx.core as mx

    for start in range(0, prompt.shape[1], chunk):
        logits = model(prompt[:, start : start + chunk], cache=cache)[:, -1]
        mx.eval(logits)
    return logits


def best_seconds(fn, repeats: int) -> float:
    """Best wall time (s) of ``fn()`` over ``repeats`` runs (``fn`` must synchronise itself)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
