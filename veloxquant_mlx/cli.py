"""``veloxquant``: demo, generate, eval (ppl | needle | speed), methods, plan, serve, calibrate.

Every compressed default is `veloxquant_mlx.options.DEFAULT_NAME` (``generate``, ``serve``; ``methods`` marks it).

The program itself starts in :mod:`veloxquant_mlx.launcher`, which re-executes the process with Debian's OpenBLAS
preloaded before this module (and MLX with it) is imported. Optional extras (matplotlib) are imported by the
functions that need them.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from typing import List, Optional

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.generate import BatchGenerator
from tqdm.auto import tqdm

from .attention import kernel as attention_kernel
from .blas import loaded_blas
from .distributed import rank_summary, shard
from .eval import corpus_tokens, passkey_eval, perplexity_eval, speed_eval
from .eval.corpus import CORPORA, CorpusMissing, DEFAULT_CORPUS
from .eval.forward import greedy_decode, prefill
from .eval.memory import DEFAULT_CONTEXT, measure_bytes_per_token, model_kv_shape, plan_context
from .calibration.file import Calibration
from .measure_calibration import calibrate
from .eval.specs import MLX_GROUP_SIZE, baseline_specs, registered_specs, resolve_spec, with_calibration
from .integration import disable, enable, use_packed_attention
from .models import ModelPackageMissing, load_model, max_context
from .options import DEFAULT_NAME
from .server import add_serve_arguments, probe_batching, serve_main

DEMO_PROMPT = "What is the capital of France?"
MAX_BITS = 16


class CLIError(Exception):
    """A user error: printed as one line on stderr; exit code ``code`` (2 for usage errors)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# ----------------------------------------------------------------------------- argument helpers
def _positive(convert, what: str):
    """An argparse type: ``convert(s)`` that must be > 0, else an error naming ``what`` was expected."""
    def parse(s: str):
        try:
            v = convert(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        if not (v > 0 and math.isfinite(v)):  # also refuses nan and inf
            raise argparse.ArgumentTypeError(f"expected {what} (finite), got {s!r}")
        return v

    return parse


_positive_int = _positive(int, "a positive integer")
_positive_float = _positive(float, "a positive number")


def _int_list(s: str) -> List[int]:
    return [_positive_int(x) for x in s.split(",") if x.strip()]


def _depths(s: str) -> List[float]:
    out = []
    for x in s.split(","):
        try:
            v = float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"depths must be numbers in [0, 1], got {x!r}")
        if not 0.0 <= v <= 1.0:
            raise argparse.ArgumentTypeError(f"depths must be within [0, 1], got {x!r}")
        out.append(v)
    return out


def _bits(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bits must be a number in (0, {MAX_BITS}], got {s!r}")
    if not 0 < v <= MAX_BITS:
        raise argparse.ArgumentTypeError(f"bits out of range: {s} (allowed: 0 < bits <= {MAX_BITS})")
    return v


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so ``main`` controls output and exit codes."""

    def error(self, message):
        raise CLIError(f"{self.prog}: {message}", code=2)


def build_parser() -> argparse.ArgumentParser:

    p = _Parser(prog="veloxquant", description="TurboQuant KV-cache compression for MLX: demo and evaluation")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def model_opt(q):
        q.add_argument("--model", default="smollm2",
                       help="'smollm2' (embedded GGUF, default), a .gguf file or an mlx_lm model directory")
        q.add_argument("--quantized-weights", action="store_true",
                       help="keep GGUF weights 4/8-bit quantized (slower on CPU) instead of float32")
        q.add_argument("--no-progress", action="store_true", help="hide progress bars")

    def calibration_opt(q, what="the compressed caches use its channel weights"):
        q.add_argument("--calibration", metavar="FILE", help=f"a calibration of this model (`veloxquant calibrate`): "
                                                             f"{what}")

    def methods_opt(q):
        q.add_argument("--methods", default="all", help="comma-separated method names, or 'all' (default)")

    d = sub.add_parser("demo", help="plain cache vs every registered method on the embedded model")
    model_opt(d)
    methods_opt(d)
    d.add_argument("--prompt", default=DEMO_PROMPT)
    d.add_argument("--context", type=_positive_int, default=513,
                   help="perplexity slice length (tokens; 513: the budget presets' exact first token and 4 whole blocks)")
    d.add_argument("--max-tokens", type=_positive_int, default=24)
    d.add_argument("--out", help="also write the results as JSON")

    g = sub.add_parser("generate", help="stream a chat answer through one cache method (several prompts: batched)")
    model_opt(g)
    g.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several (generated batched)")
    g.add_argument("--prompts-file", help="a text file with one prompt per line (added to any --prompt)")
    g.add_argument("--method", default=DEFAULT_NAME,
                   help=f"the KV cache: default {DEFAULT_NAME} (the default of `enable(model)` and `serve` too); "
                        "kv/fp16 for mlx_lm's plain cache, mlx-q8/q4/q2, any name of `veloxquant methods`, a family "
                        "with --bits")
    g.add_argument("--bits", type=_bits, default=None)
    g.add_argument("--max-tokens", type=_positive_int, default=128)
    g.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text")
    g.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the layers over the ranks (default: tensor parallel, split heads)")
    calibration_opt(g)

    e = sub.add_parser("eval", help="perplexity/KL, passkey retrieval or speed; JSON output")
    esub = e.add_subparsers(dest="eval_kind", metavar="KIND", parser_class=_Parser)
    esub.required = True
    ep = esub.add_parser("ppl", help="perplexity, Δ vs plain cache, KL, top-1 agreement")
    ep.add_argument("--contexts", type=_int_list, default=[512])
    ep.add_argument("--windows", type=_positive_int, default=1, help="windows per context (window i at token i*context)")
    ep.add_argument("--plot", help="PNG: Δ perplexity against bits per coordinate (needs matplotlib)")
    en = esub.add_parser("needle", help="passkey retrieval at several lengths and depths")
    en.add_argument("--lengths", type=_int_list, default=[1024, 2048, 4096])
    en.add_argument("--depths", type=_depths, default=[0.1, 0.5, 0.9])
    en.add_argument("--seed", type=int, default=0)
    es = esub.add_parser("speed", help="prefill/decode tokens per second, cache bytes, peak memory")
    es.add_argument("--context", type=_positive_int, default=512)
    es.add_argument("--decode-tokens", type=_positive_int, default=32)
    for q in (ep, en, es):
        model_opt(q)
        methods_opt(q)
        q.add_argument("--out", help="write the results as JSON")
        q.add_argument("--corpus", default=DEFAULT_CORPUS, choices=tuple(CORPORA),
                       help=f"evaluation text (default {DEFAULT_CORPUS}; each installed by scripts/setup.sh)")
        if q is not ep:
            q.set_defaults(plot=None)
        calibration_opt(q, "every compressed method is also run with it (a '+cal' row each)")

    m = sub.add_parser("methods", help="registered methods with measured bytes per token per layer (marks the default)")
    m.add_argument("--head-dim", type=_positive_int, default=64)
    m.add_argument("--kv-heads", type=_positive_int, default=1)

    pl = sub.add_parser("plan", help="longest context whose KV cache fits in RAM, per method")
    pl.add_argument("--layers", type=_positive_int, required=True)
    pl.add_argument("--kv-heads", type=_positive_int, required=True)
    pl.add_argument("--head-dim", type=_positive_int, required=True)
    pl.add_argument("--ram-gb", type=_positive_float, required=True, help="memory for the KV cache, GiB")
    c = sub.add_parser("calibrate", help="measure a model once for calibrated caches (--calibration FILE)")
    model_opt(c)
    c.add_argument("--out", required=True, help="the calibration file to write (.safetensors)")
    c.add_argument("--text-file", help="calibration text (UTF-8); default: the model's own answers to fixed prompts")
    c.add_argument("--max-tokens", type=_positive_int, default=4096, help="tokens of --text-file used (default 4096)")

    sv = sub.add_parser("serve", help="OpenAI-compatible server (mlx_lm.server) with compressed KV caches")
    add_serve_arguments(sv)
    return p


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


def _select_specs(model_or_head_dim, methods: str):

    head_dim = model_or_head_dim if isinstance(model_or_head_dim, int) else model_kv_shape(model_or_head_dim)[2]
    specs = registered_specs(head_dim)
    if methods.strip() == "all":
        return specs
    chosen = []
    for name in [m.strip() for m in methods.split(",") if m.strip()]:
        s = resolve_spec(name, None, head_dim)  # raises ValueError naming the allowed methods
        if s.name not in {c.name for c in chosen}:
            chosen.append(s)
    if not chosen:
        raise CLIError("--methods: no method given")
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
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'veloxquant-mlx[plot]' (or pip install matplotlib)")


def plot_ppl(results: dict, path: str) -> None:
    """Δ perplexity against measured bits per coordinate, one marker series per method family."""
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


# ----------------------------------------------------------------------------- commands
def cmd_demo(args) -> int:

    _check_writable(args.out, "--out")
    model, tok = _load(args)
    _check_context(model, args.context, "--context")
    specs = _with_reference(_select_specs(model, args.methods))
    tokens = corpus_tokens(tok)
    ppl = perplexity_eval(model, tokens, specs, args.context, n_windows=1, progress=not args.no_progress)
    ids = _chat_ids(tok, args.prompt)
    eos = getattr(tok, "eos_token_ids", None) or []
    results = {"prompt": args.prompt, "context": args.context, "attention_path": attention_kernel.status()[1],
               "methods": {}}
    for s in tqdm(specs, desc="answers", disable=args.no_progress, leave=False):
        cache = s.make_cache(model)
        logits = prefill(model, ids, cache)
        t0 = time.perf_counter()
        gen = greedy_decode(model, logits, cache, args.max_tokens, eos_ids=eos)
        dt = time.perf_counter() - t0
        results["methods"][s.name] = {
            "spec": s.to_dict(),
            "ppl": ppl[s.name],
            "decode_tokens_per_s": len(gen) / dt,
            "answer": tok.decode([t for t in gen if t not in eos]).strip(),
        }
    rows = []
    for name, r in results["methods"].items():
        mem = r["ppl"]["memory"]
        rows.append([name, f"{mem['bits_per_coordinate']:.2f}", f"{mem['mib_total']:.2f}",
                     f"{r['ppl']['ppl']:.3f}", f"{r['ppl']['delta_ppl']:+.3f}", f"{r['ppl']['kl']:.4f}",
                     f"{r['decode_tokens_per_s']:.1f}"])
    print(f"\nperplexity slice: {args.context} tokens of the Debian Reference (window 0); prompt: {args.prompt!r}")
    c = attention_kernel.calls()
    results["kernel_calls"] = c
    print(f"attention on codes: {attention_kernel.status()[1]}; decode calls on the kernel {c['kernel']}, refused "
          f"by it (run on the reference) {c['refused']}")
    print(_table(["method", "bits/coord", f"KV MiB @{args.context}", "ppl", "Δppl", "KL", "decode tok/s"], rows))
    print()
    for name, r in results["methods"].items():
        print(f"[{name}] {r['answer']}")
    _write_json(args.out, results)
    return 0


def cmd_generate(args) -> int:


    group = mx.distributed.init()  # one rank unless launched with mlx.launch
    if args.pipeline and group.size() == 1:
        raise CLIError("--pipeline splits the layers over the ranks of mlx.launch; this is a single process")
    prompts = list(args.prompt) + (_read_prompts(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        raise CLIError("generate needs a prompt: --prompt TEXT (repeatable) or --prompts-file FILE")
    if len(prompts) > 1 and group.size() > 1:
        raise CLIError("several prompts are generated batched in one process; under mlx.launch give one --prompt")
    model, tok = _load(args)
    spec = resolve_spec(args.method, args.bits, model_kv_shape(model)[2])
    cal = _load_calibration(args, model)
    if cal is not None:
        try:
            spec = with_calibration(spec, cal)
        except ValueError as e:
            raise CLIError(f"--calibration with --method {spec.name}: {e}")
    all_ids = [_chat_ids(tok, p, raw=args.raw) for p in prompts]
    for ids in all_ids:
        _check_context(model, len(ids) + args.max_tokens, "prompt plus --max-tokens")
    if len(all_ids) > 1:
        return _generate_batched(args, model, tok, spec, all_ids, cal)
    ids = all_ids[0]
    shard(model, group, pipeline=args.pipeline)
    cache = None
    if spec.options is not None:
        enable(model, spec.options, calibration=cal)  # mlx_lm builds our caches itself, attends from their codes
    else:
        cache = spec.make_cache(model)
    try:
        _say(f"[{spec.name}] {rank_summary(model, spec.make_cache, group)}")
        leader, last = group.rank() == 0, None
        for resp in stream_generate(model, tok, ids, max_tokens=args.max_tokens, prompt_cache=cache,
                                    prefill_step_size=256):
            if leader:
                print(resp.text, end="", flush=True)
            last = resp
    finally:
        disable(model)
    if leader:
        print()
    if last is not None and leader:
        _say(f"[{spec.name}] prompt {last.prompt_tokens} tok at {last.prompt_tps:.1f} tok/s, "
             f"generated {last.generation_tokens} tok at {last.generation_tps:.1f} tok/s")
    return 0


def _read_prompts(path: str) -> List[str]:
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"--prompts-file {path!r} cannot be read: {e}")
    if not prompts:
        raise CLIError(f"--prompts-file {path!r} holds no prompt (one per line)")
    return prompts


def _generate_batched(args, model, tok, spec, all_ids, cal=None) -> int:
    """Several prompts through mlx_lm's BatchGenerator (continuous batching); each answer printed when done."""


    ok, why = probe_batching(model, spec.make_cache)
    if not ok:
        raise CLIError(f"--method {spec.name} cannot batch several prompts ({why}); give one --prompt")
    if spec.options is not None:
        enable(model, spec.options, calibration=cal)  # BatchGenerator makes our caches and merges them into batch caches
    try:
        gen = BatchGenerator(model, max_tokens=args.max_tokens, stop_tokens=[[t] for t in tok.eos_token_ids],
                             prefill_step_size=256)
        caches = None if spec.options is not None else [spec.make_cache(model) for _ in all_ids]
        uids = gen.insert(all_ids, caches=caches)
        tokens, t0 = {uid: [] for uid in uids}, time.perf_counter()
        while responses := gen.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    tokens[r.uid].append(r.token)
                if r.finish_reason is not None:
                    print(f"[{uids.index(r.uid) + 1}] {tok.decode(tokens[r.uid])}", flush=True)
        gen.close()
    finally:
        disable(model)
    n = sum(len(t) for t in tokens.values())
    _say(f"[{spec.name}] {len(all_ids)} prompts batched: generated {n} tok in {time.perf_counter() - t0:.1f} s")
    return 0


def cmd_eval(args) -> int:

    if args.plot and args.eval_kind != "ppl":
        raise CLIError("--plot is only available for `eval ppl`")
    _check_writable(args.out, "--out")
    _check_writable(args.plot, "--plot")
    if args.plot:
        _require_matplotlib()
    model, tok = _load(args)
    specs = _select_specs(model, args.methods)
    cal = _load_calibration(args, model)
    if cal is not None:
        specs = specs + [with_calibration(s, cal, "+cal") for s in specs
                         if s.options is not None and s.options.kind == "packed"]
    progress = not args.no_progress
    tokens = corpus_tokens(tok, args.corpus)
    out = {"kind": args.eval_kind, "model": args.model, "corpus": args.corpus, "methods": [s.to_dict() for s in specs]}
    if args.eval_kind == "ppl":
        for c in args.contexts:
            _check_context(model, c, "--contexts")
        specs = _with_reference(specs)
        out["ppl"] = {}
        for c in args.contexts:
            out["ppl"][str(c)] = perplexity_eval(model, tokens, specs, c, n_windows=args.windows, progress=progress)
        rows = [[name, ctx, f"{r['memory']['bits_per_coordinate']:.2f}", f"{r['ppl']:.3f}",
                 f"{r['delta_ppl']:+.3f}", f"{r['kl']:.4f}", f"{r['top1']:.3f}"]
                for ctx, per in out["ppl"].items() for name, r in per.items()]
        print(_table(["method", "ctx", "bits/coord", "ppl", "Δppl", "KL", "top-1"], rows))
    elif args.eval_kind == "needle":
        for L in args.lengths:
            _check_context(model, L + 16, "--lengths")
        out["needle"] = passkey_eval(model, tok, tokens, specs, lengths=args.lengths, depths=args.depths,
                                     seed=args.seed, progress=progress)
        print(_table(["method", "passed"], [[n, f"{r['passed']}/{r['total']}"] for n, r in out["needle"].items()]))
    else:
        _check_context(model, args.context + args.decode_tokens, "--context plus --decode-tokens")
        out["speed"] = {s.name: speed_eval(model, tokens, s, args.context, decode_tokens=args.decode_tokens,
                                           progress=progress) for s in specs}
        rows = [[n, f"{r['prefill_tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.1f}",
                 f"{r['bytes_per_token']:.0f}", f"{r['bits_per_coordinate']:.2f}", f"{r['peak_memory_bytes'] / 2**20:.1f}"]
                for n, r in out["speed"].items()]
        print(_table(["method", "prefill tok/s", "decode tok/s", "bytes/token", "bits/coord", "peak MiB"], rows))
    _write_json(args.out, out)
    if args.plot:
        plot_ppl(out, args.plot)
    return 0


def _inapplicable(spec, head_dim: int) -> Optional[str]:
    """Why ``spec`` cannot take ``head_dim`` when that is known without building it (mlx_lm's own caches), or None."""
    # mx.quantize needs whole groups along the head dim; without this check MLX fails inside the first update.
    if spec.family == "mlx-q" and head_dim % MLX_GROUP_SIZE:
        return f"needs head_dim a multiple of {MLX_GROUP_SIZE} (mlx_lm QuantizedKVCache group_size)"
    return None


def _measure_all(head_dim: int, kv_heads: int):
    """``[(spec, measurement, None)]`` for the methods that take ``head_dim``, ``(spec, None, why not)`` for the
    others, in registry order; the others are named on stderr in one line, and CLIError when no method applies.

    Our caches refuse a head_dim they cannot code with a ValueError that says why (d >= 2, whole affine groups):
    that method is listed as not applicable rather than ending the command."""
    rows = []
    for s in registered_specs(head_dim):
        why = _inapplicable(s, head_dim)
        if why is None:
            try:
                rows.append((s, measure_bytes_per_token(s.make_cache, kv_heads, head_dim), None))
                continue
            except ValueError as e:
                why = str(e)
        rows.append((s, None, why))
    skipped = [(s, why) for s, m, why in rows if m is None]
    if len(skipped) == len(rows):
        raise CLIError(f"--head-dim {head_dim}: no method applies ({_reasons(skipped)})")
    if skipped:
        _say(f"veloxquant: note: {len(skipped)} of {len(rows)} methods do not apply at head_dim={head_dim} (n/a): "
             f"{_reasons(skipped)}")
    return rows


def _reasons(skipped) -> str:
    """``name, name: why; ...``: the methods grouped by reason, on one line."""
    by_reason = {}
    for s, why in skipped:
        by_reason.setdefault(why, []).append(s.name)
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())


def _measured(head_dim: int, kv_heads: int):
    """``[(spec, measurement)]`` of the methods that take ``head_dim`` (see `_measure_all`)."""
    return [(s, m) for s, m, _ in _measure_all(head_dim, kv_heads) if m is not None]


DEFAULT_MARK = "(default) "


def cmd_methods(args) -> int:

    rows = [[s.name, s.family, "-" if s.bits is None else f"{s.bits:g}"] + (
             [f"{m['bytes_per_token_per_layer']:.1f}", f"{m['bits_per_coordinate']:.3f}",
              (DEFAULT_MARK if s.name == DEFAULT_NAME else "") + s.description] if m is not None else
             ["n/a", "n/a", f"not applicable at head_dim={args.head_dim}: {why}"])
            for s, m, why in _measure_all(args.head_dim, args.kv_heads)]
    print(f"measured with head_dim={args.head_dim}, kv_heads={args.kv_heads}: every stored byte of one layer holding "
          f"{DEFAULT_CONTEXT} random tokens, its sink and the tokens waiting for a block among them (the benchmarks' "
          "measurement, veloxquant_mlx.eval.memory)")
    print(_table(["method", "family", "bits", f"bytes/token/layer @{DEFAULT_CONTEXT}", f"bits/coord @{DEFAULT_CONTEXT}",
                  "description"], rows))
    print(f"default: {DEFAULT_NAME} (`generate`, `serve`, `enable(model)` and `make_prompt_cache(model)` without "
          "options); kv is mlx_lm's plain cache")
    return 0


def cmd_calibrate(args) -> int:
    """Measure the model on calibration text and write the calibration file."""
    _check_writable(args.out, "--out")
    if not args.out.endswith(".safetensors"):
        raise CLIError(f"--out must end in .safetensors, got {args.out!r}")
    model, tok = _load(args)
    tokens, description = None, None
    if args.text_file:
        try:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"--text-file {args.text_file!r} cannot be read: {e}")
        tokens = list(tok.encode(text, add_special_tokens=False))[: args.max_tokens]
        if len(tokens) < 2:
            raise CLIError(f"--text-file {args.text_file!r} holds fewer than 2 tokens")
        description = f"{os.path.basename(args.text_file)} (first {len(tokens)} tokens)"
    try:
        cal = calibrate(model, tokens, tokenizer=tok, description=description, progress=not args.no_progress)
    except ValueError as e:
        raise CLIError(str(e))
    cal.save(args.out)
    print(f"calibration {cal.id}: {cal.text['tokens']} tokens of {cal.text['description']} in "
          f"{cal.text['seconds']:.1f} s; {os.path.getsize(args.out)} bytes written to {args.out} (per model, not per "
          f"token); use it with --calibration {args.out}")
    return 0


def cmd_serve(args) -> int:

    return serve_main(args)


def cmd_plan(args) -> int:

    ram = args.ram_gb * 2**30
    rows = []
    for s, m, _ in _measure_all(args.head_dim, args.kv_heads):  # why a method is n/a is said on stderr
        if m is None:
            rows.append([s.name, "n/a", "n/a"])
            continue
        bpt = m["bytes_per_token_per_layer"]
        rows.append([s.name, f"{bpt * args.layers:.0f}", f"{plan_context(bpt, args.layers, ram):,}"])
    print(f"KV cache budget {args.ram_gb:g} GiB; {args.layers} layers x {args.kv_heads} kv heads x head_dim {args.head_dim}")
    print(_table(["method", "bytes/token (all layers)", "max context (tokens)"], rows))
    return 0


# Commands that run models: inside use_packed_attention() (serve installs it in its own serving context).
ATTENTION_ON_CODES = ("demo", "generate", "eval")
COMMANDS = {"demo": cmd_demo, "generate": cmd_generate, "eval": cmd_eval, "methods": cmd_methods, "plan": cmd_plan,
            "serve": cmd_serve, "calibrate": cmd_calibrate}


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point. ``argv=None`` means a real process: re-exec with OpenBLAS first if useful."""
    if argv is None:
        argv = sys.argv[1:]

    try:
        args = build_parser().parse_args(argv)
        if args.command in ATTENTION_ON_CODES:
            # Our caches attend straight from their codes (same results up to float32 rounding, faster);
            # other caches are untouched. Undone when the command returns.
            with use_packed_attention():
                return COMMANDS[args.command](args)
        return COMMANDS[args.command](args)
    except (CLIError, ValueError, TypeError, OSError, ModelPackageMissing, CorpusMissing) as e:
        msg = str(e)
        print(msg if msg.startswith("veloxquant") else f"veloxquant: error: {msg}", file=sys.stderr)
        return e.code if isinstance(e, CLIError) else 1
    except SystemExit as e:  # argparse --help
        return int(e.code or 0)
    except KeyboardInterrupt:
        print("veloxquant: interrupted", file=sys.stderr)
        return 130


def exit_process(code: int) -> None:
    """End a real process after a command: flush, then ``os._exit``.

    After ``veloxquant serve`` has stopped every thread it started, mlx_lm's generation thread leaves a
    thread-local MLX stream behind whose C++ worker is destroyed at interpreter exit, which aborts the process
    ("terminate called without an active exception") about one run in three; everything is closed by then, so
    the process ends without running those destructors.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


