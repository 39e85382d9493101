"""The commands that measure and plan: ``eval`` (ppl | needle | speed), ``presets`` (old name ``methods``),
``plan``, ``calibrate``; and ``serve`` (the server's own module does the work)."""
from __future__ import annotations

import os
from typing import Optional

from veloxquant_mlx.apps.eval import corpus_tokens, passkey_eval, perplexity_eval, speed_eval
from veloxquant_mlx.apps.eval.memory import DEFAULT_CONTEXT, measure_bytes_per_token, plan_context
from veloxquant_mlx.apps.eval.specs import MLX_GROUP_SIZE, registered_specs, with_calibration
from veloxquant_mlx.integration.measure_calibration import calibrate
from veloxquant_mlx.cache.presets import DEFAULT_NAME
from veloxquant_mlx.apps.server import serve_main
from veloxquant_mlx.apps.cli.common import (CLIError, _check_context, _check_writable, _load, _load_calibration, _require_matplotlib, _say,
                     _select_specs, _table, _with_reference, _write_json, plot_ppl)


def cmd_eval(args) -> int:

    if args.plot and args.eval_kind != "ppl":
        raise CLIError("--plot is only available for `eval ppl`")
    _check_writable(args.out, "--out")
    _check_writable(args.plot, "--plot")
    if args.plot:
        _require_matplotlib()
    model, tok = _load(args)
    specs = _select_specs(model, args.presets)
    cal = _load_calibration(args, model)
    if cal is not None:
        specs = specs + [with_calibration(s, cal, "+cal") for s in specs
                         if s.options is not None and s.options.kind == "packed"]
    progress = not args.no_progress
    tokens = corpus_tokens(tok, args.corpus)
    out = {"kind": args.eval_kind, "model": args.model, "corpus": args.corpus, "presets": [s.to_dict() for s in specs]}
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
        print(_table(["preset", "ctx", "bits/coord", "ppl", "Δppl", "KL", "top-1"], rows))
    elif args.eval_kind == "needle":
        for L in args.lengths:
            _check_context(model, L + 16, "--lengths")
        out["needle"] = passkey_eval(model, tok, tokens, specs, lengths=args.lengths, depths=args.depths,
                                     seed=args.seed, progress=progress)
        print(_table(["preset", "passed"], [[n, f"{r['passed']}/{r['total']}"] for n, r in out["needle"].items()]))
    else:
        _check_context(model, args.context + args.decode_tokens, "--context plus --decode-tokens")
        out["speed"] = {s.name: speed_eval(model, tokens, s, args.context, decode_tokens=args.decode_tokens,
                                           progress=progress) for s in specs}
        rows = [[n, f"{r['prefill_tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.1f}",
                 f"{r['bytes_per_token']:.0f}", f"{r['bits_per_coordinate']:.2f}", f"{r['peak_memory_bytes'] / 2**20:.1f}"]
                for n, r in out["speed"].items()]
        print(_table(["preset", "prefill tok/s", "decode tok/s", "bytes/token", "bits/coord", "peak MiB"], rows))
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
    """``[(spec, measurement, None)]`` for the presets (and mlx_lm's caches) that take ``head_dim``, ``(spec, None,
    why not)`` for the others, in registry order; the others are named on stderr in one line, and CLIError when none
    applies.

    Our caches refuse a head_dim they cannot code with a ValueError that says why (d >= 2, whole affine groups):
    that preset is listed as not applicable rather than ending the command."""
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
        raise CLIError(f"--head-dim {head_dim}: no preset applies ({_reasons(skipped)})")
    if skipped:
        _say(f"veloxquant: note: {len(skipped)} of {len(rows)} presets do not apply at head_dim={head_dim} (n/a): "
             f"{_reasons(skipped)}")
    return rows


def _reasons(skipped) -> str:
    """``name, name: why; ...``: the presets grouped by reason, on one line."""
    by_reason = {}
    for s, why in skipped:
        by_reason.setdefault(why, []).append(s.name)
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())


def _measured(head_dim: int, kv_heads: int):
    """``[(spec, measurement)]`` of the presets that take ``head_dim`` (see `_measure_all`)."""
    return [(s, m) for s, m, _ in _measure_all(head_dim, kv_heads) if m is not None]


DEFAULT_MARK = "(default) "


def cmd_presets(args) -> int:
    """``veloxquant presets``: every preset and mlx_lm's caches, measured at ``--head-dim`` / ``--kv-heads``."""
    rows = [[s.name, s.family, "-" if s.bits is None else f"{s.bits:g}"] + (
             [f"{m['bytes_per_token_per_layer']:.1f}", f"{m['bits_per_coordinate']:.3f}",
              (DEFAULT_MARK if s.name == DEFAULT_NAME else "") + s.description] if m is not None else
             ["n/a", "n/a", f"not applicable at head_dim={args.head_dim}: {why}"])
            for s, m, why in _measure_all(args.head_dim, args.kv_heads)]
    print(f"measured with head_dim={args.head_dim}, kv_heads={args.kv_heads}: every stored byte of one layer holding "
          f"{DEFAULT_CONTEXT} random tokens, its sink and the tokens waiting for a block among them (the benchmarks' "
          "measurement, veloxquant_mlx.apps.eval.memory)")
    print(_table(["preset", "family", "bits", f"bytes/token/layer @{DEFAULT_CONTEXT}", f"bits/coord @{DEFAULT_CONTEXT}",
                  "description"], rows))
    print(f"default: {DEFAULT_NAME} (`generate`, `serve`, `enable(model)` and `make_prompt_cache(model)` without "
          "options); kv and mlx-q8/q4/q2 are mlx_lm's own caches, to compare against")
    return 0


cmd_methods = cmd_presets  # its old name (the command `methods` is now `presets`)


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
    for s, m, _ in _measure_all(args.head_dim, args.kv_heads):  # why a preset is n/a is said on stderr
        if m is None:
            rows.append([s.name, "n/a", "n/a"])
            continue
        bpt = m["bytes_per_token_per_layer"]
        rows.append([s.name, f"{bpt * args.layers:.0f}", f"{plan_context(bpt, args.layers, ram):,}"])
    print(f"KV cache budget {args.ram_gb:g} GiB; {args.layers} layers x {args.kv_heads} kv heads x head_dim {args.head_dim}")
    print(_table(["preset", "bytes/token (all layers)", "max context (tokens)"], rows))
    return 0
