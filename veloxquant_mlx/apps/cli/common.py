"""Pieces the commands share: the user error, loading the model and a calibration, checks made before any work,
preset selection, writing JSON, tables, chat prompts, the perplexity plot."""
from __future__ import annotations

import importlib.util

import json
import os
import sys
import time
from typing import List, Optional

from veloxquant_mlx.apps.blas import loaded_blas
from veloxquant_mlx.integration.calibration import Calibration
from veloxquant_mlx.apps.eval.memory import model_kv_shape
from veloxquant_mlx.apps.eval.specs import baseline_specs, registered_specs, resolve_spec
from veloxquant_mlx.apps.models import load_model, max_context


class CLIError(Exception):
    """A user error: printed as one line on stderr; exit code ``code`` (2 for usage errors)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------- shared pieces
def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load(args):

    t0 = time.perf_counter()
    model, tok = load_model(args.model, quantized=args.quantized_weights)
    _say(f"model {args.model} loaded in {time.perf_counter() - t0:.1f} s; BLAS: {loaded_blas()}")
    return model, tok


def _load_calibration(args, model):
    """``--calibration FILE`` of this model, or None (CLIError naming the file when it does not belong)."""
    if not getattr(args, "calibration", None):
        return None
    try:
        return Calibration.load(args.calibration, model)
    except (ValueError, OSError, TypeError) as e:
        raise CLIError(f"--calibration: {e}")


def _check_context(model, n: int, what: str) -> None:

    limit = max_context(model)
    if limit is not None and n > limit:
        raise CLIError(f"{what} of {n} tokens is longer than the model allows ({limit})")


def _select_specs(model_or_head_dim, presets: str):
    """The specs of ``--presets`` ('all', or comma-separated names), in the order given, each once."""
    head_dim = model_or_head_dim if isinstance(model_or_head_dim, int) else model_kv_shape(model_or_head_dim)[2]
    specs = registered_specs(head_dim)
    if presets.strip() == "all":
        return specs
    chosen = []
    for name in [m.strip() for m in presets.split(",") if m.strip()]:
        s = resolve_spec(name, None, head_dim)  # raises ValueError naming the presets
        if s.name not in {c.name for c in chosen}:
            chosen.append(s)
    if not chosen:
        raise CLIError("--presets: no preset given")
    return chosen


def _with_reference(specs):

    ref = baseline_specs()[0]
    return specs if any(s.name == ref.name for s in specs) else [ref] + list(specs)


def _check_writable(path: Optional[str], flag: str) -> None:
    """Fail before any work when ``path`` cannot be written: it is a directory, or its nearest existing
    ancestor is not a writable directory (the folders below it would be created by `_write_json`)."""
    if not path:
        return
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise CLIError(f"{flag} {path!r} is a directory")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise CLIError(f"{flag} {path!r} is not writable")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise CLIError(f"{flag} {path!r} cannot be written: {parent!r} is not a writable directory")


def _write_json(path: Optional[str], data) -> None:
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    _say(f"wrote {path}")


def _table(headers: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _chat_ids(tok, prompt: str, raw: bool = False) -> List[int]:
    if not raw and getattr(tok, "has_chat_template", False):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))
    return list(tok.encode(prompt))


def _require_matplotlib():
    if importlib.util.find_spec("matplotlib") is None:  # asked before the run, not imported until the plot
        raise CLIError("--plot needs matplotlib: pip install 'veloxquant-mlx[plot]' (or pip install matplotlib)")


def plot_ppl(results: dict, path: str) -> None:
    """Δ perplexity against measured bits per coordinate, one marker series per preset and context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for ctx, per_method in results["ppl"].items():
        for name, r in per_method.items():
            ax.scatter(r["memory"]["bits_per_coordinate"], r["delta_ppl"], label=f"{name} @ {ctx}")
    ax.set_xlabel("bits per coordinate (measured)")
    ax.set_ylabel("Δ perplexity vs plain KVCache")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    _say(f"wrote {path}")
