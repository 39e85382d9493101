"""The commands that run a model on prompts: ``demo`` (the plain cache against every preset on the embedded model)
and ``generate`` (one preset, streamed; several prompts batched)."""
from __future__ import annotations

import time
from typing import List

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.generate import BatchGenerator
from tqdm.auto import tqdm

from veloxquant_mlx.attention import kernel as attention_kernel
from veloxquant_mlx.apps.distributed import rank_summary, shard
from veloxquant_mlx.apps.eval import corpus_tokens, perplexity_eval
from veloxquant_mlx.apps.eval.forward import greedy_decode, prefill
from veloxquant_mlx.apps.eval.memory import model_kv_shape
from veloxquant_mlx.apps.eval.specs import resolve_spec, with_calibration
from veloxquant_mlx.integration.enabling import disable, enable
from veloxquant_mlx.apps.server import probe_batching
from veloxquant_mlx.apps.cli.common import (CLIError, _chat_ids, _check_context, _check_writable, _load, _load_calibration, _say,
                     _select_specs, _table, _with_reference, _write_json)


# ----------------------------------------------------------------------------- commands
def cmd_demo(args) -> int:

    _check_writable(args.out, "--out")
    model, tok = _load(args)
    _check_context(model, args.context, "--context")
    specs = _with_reference(_select_specs(model, args.presets))
    tokens = corpus_tokens(tok)
    ppl = perplexity_eval(model, tokens, specs, args.context, n_windows=1, progress=not args.no_progress)
    ids = _chat_ids(tok, args.prompt)
    eos = getattr(tok, "eos_token_ids", None) or []
    results = {"prompt": args.prompt, "context": args.context, "attention_path": attention_kernel.status()[1],
               "presets": {}}
    for s in tqdm(specs, desc="answers", disable=args.no_progress, leave=False):
        cache = s.make_cache(model)
        logits = prefill(model, ids, cache)
        t0 = time.perf_counter()
        gen = greedy_decode(model, logits, cache, args.max_tokens, eos_ids=eos)
        dt = time.perf_counter() - t0
        results["presets"][s.name] = {
            "spec": s.to_dict(),
            "ppl": ppl[s.name],
            "decode_tokens_per_s": len(gen) / dt,
            "answer": tok.decode([t for t in gen if t not in eos]).strip(),
        }
    rows = []
    for name, r in results["presets"].items():
        mem = r["ppl"]["memory"]
        rows.append([name, f"{mem['bits_per_coordinate']:.2f}", f"{mem['mib_total']:.2f}",
                     f"{r['ppl']['ppl']:.3f}", f"{r['ppl']['delta_ppl']:+.3f}", f"{r['ppl']['kl']:.4f}",
                     f"{r['decode_tokens_per_s']:.1f}"])
    print(f"\nperplexity slice: {args.context} tokens of the Debian Reference (window 0); prompt: {args.prompt!r}")
    c = attention_kernel.calls()
    results["kernel_calls"] = c
    print(f"attention on codes: {attention_kernel.status()[1]}; decode calls on the kernel {c['kernel']}, refused "
          f"by it (run on the reference) {c['refused']}")
    print(_table(["preset", "bits/coord", f"KV MiB @{args.context}", "ppl", "Δppl", "KL", "decode tok/s"], rows))
    print()
    for name, r in results["presets"].items():
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
    spec = resolve_spec(args.preset, args.bits, model_kv_shape(model)[2])
    cal = _load_calibration(args, model)
    if cal is not None:
        try:
            spec = with_calibration(spec, cal)
        except ValueError as e:
            raise CLIError(f"--calibration with --preset {spec.name}: {e}")
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
        raise CLIError(f"--preset {spec.name} cannot batch several prompts ({why}); give one --prompt")
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
