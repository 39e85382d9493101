"""Issue 54: could a key block be coded on arrival, its per-channel ranges set when it opens? Key error only.

The budget layout codes keys per rotated channel over 128-token blocks with each block's own ranges, so up to 127
newest tokens wait for their block: exact (5.9 bits at 2048 tokens for ``tq-4b``) or as provisional per-token codes
(``kblock_vsym8_pt``: one bit more, the block later coded from their reconstruction). A layout with no waiting
tokens would code each key once, on arrival, with ranges fixed when its block opens: from the previous block's
observed per-channel min / max (``pred F``: widened by F around its centre), or (``pred-run``, not storable: for
comparison only) the running min / max of the previous block and this block's tokens so far.

Measured here as the relative squared error ``|k_hat - k|^2 / |k|^2`` of the keys as the caches code them (after
RoPE, less the rotated pre-RoPE mean ``R_t mu`` of ``rope_offset``, in a random rotation's channels, 4-bit levels),
per 128-token block after the sink, averaged over layers, heads and blocks, against

- ``own``: min / max of the block itself (``own-mse``: each channel's range clipped to its least-squared-error
  fraction, as the block codec does): what a completed block costs;
- ``ptE-wait`` / ``ptE-final``: per-token symmetric codes at 4 + E bits while waiting, then the block coded from
  their reconstruction (the coded tail of ``kblock_vsym8_pt``; E = 1 in it).

NumPy replicas of the codecs' grids (uniform levels over each range; symmetric per-token levels scaled by each
token's max-abs), not the codecs themselves: figures to choose a design by, not a layout's KL. The text is fitted
on nothing and is none of the evaluation corpora: ``--text-file`` (default: Debian's GPL-3 text).

    python -m benchmarks.probes.block_ranges --out results/block_ranges.json         # SmolLM2, 2048 tokens
    python -m benchmarks.probes.block_ranges --smoke --out /tmp/block_ranges.json    # a tiny random model
"""
from __future__ import annotations

import json
import os

from veloxquant_mlx.apps.blas import ensure_openblas

BLOCK = 128
TEXT = "/usr/share/common-licenses/GPL-3"


def uniform(y, lo, hi, bits=4):
    import numpy as np

    top = 2 ** bits - 1
    step = np.maximum(hi - lo, 1e-8) / top
    return lo + np.clip(np.round((y - lo) / step), 0, top) * step


def per_token(y, bits):
    """Symmetric levels per token, scaled by its max-abs (the provisional codes' grid, without the log-grid scale)."""
    import numpy as np

    top = 2 ** (bits - 1) - 1
    step = (np.abs(y).max(-1, keepdims=True) + 1e-8) / top
    return np.clip(np.round(y / step), -top - 1, top) * step


def clipped(y, lo, hi, bits=4):
    """Each channel's range clipped to the fraction (1 .. 0.7) of least squared error, as the block codec does."""
    import numpy as np

    best, out = None, None
    for f in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
        mid, half = (hi + lo) / 2, (hi - lo) / 2 * f
        r = uniform(y, mid - half, mid + half, bits)
        e = ((r - y) ** 2).sum(0)
        if best is None:
            best, out = e, r.copy()
        else:
            better = e < best
            best, out[:, better] = np.where(better, e, best), r[:, better]
    return out


def block_errors(y, out: dict) -> None:
    """Append each variant's relative error of every block of ``y`` ``(T, d)`` (tokens after the sink) to ``out``."""
    import numpy as np

    prev = None
    for b in range(y.shape[0] // BLOCK):
        blk = y[b * BLOCK:(b + 1) * BLOCK]
        lo, hi = blk.min(0), blk.max(0)
        got = {"own": uniform(blk, lo, hi), "own-mse": clipped(blk, lo, hi)}
        if prev is not None:
            plo, phi = prev
            for f in (1.0, 1.1, 1.25):
                mid, half = (plo + phi) / 2, (phi - plo) / 2 * f
                got[f"pred {f}"] = uniform(blk, mid - half, mid + half)
            rlo = np.minimum.accumulate(np.vstack([plo[None], blk]), 0)[1:]
            rhi = np.maximum.accumulate(np.vstack([phi[None], blk]), 0)[1:]
            got["pred-run"] = uniform(blk, rlo, rhi)
        for e in (0, 1):
            wait = per_token(blk, 4 + e)
            got[f"pt{e}-wait"], got[f"pt{e}-final"] = wait, clipped(wait, wait.min(0), wait.max(0))
        den = float((blk ** 2).sum())
        for name, r in got.items():
            out.setdefault(name, []).append(float(((r - blk) ** 2).sum()) / den)
        prev = (lo, hi)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text-file", default=TEXT)
    ap.add_argument("--smoke", action="store_true", help="a tiny random llama, 2 blocks: the code runs")
    ap.add_argument("--out", default="results/block_ranges.json")
    args = ap.parse_args(argv)
    ensure_openblas()
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.quant.rope import fit_mean, frame_of, rotate

    if args.smoke:
        from mlx_lm.models import llama

        mx.random.seed(0)
        model = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5,
                                            hidden_size=128, intermediate_size=128, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=128))
        ids, name = [int(t) for t in np.random.default_rng(0).integers(1, 128, 1 + 3 * BLOCK)], "tiny random llama"
    else:
        from veloxquant_mlx.apps.models import load_model

        if not os.path.isfile(args.text_file):
            raise SystemExit(f"--text-file {args.text_file!r} not found: give a text that is none of the "
                             "evaluation corpora")
        model, tokenizer = load_model("smollm2")
        ids = tokenizer.encode(open(args.text_file, encoding="utf-8").read())[:args.tokens + 1]
        name = "SmolLM2-135M"
    cache = make_prompt_cache(model)
    for s in range(0, len(ids), 512):  # (a chunked prefill, as mlx_lm's)
        model(mx.array(ids[s:s + 512])[None], cache=cache)
        mx.eval([c.state for c in cache])
    rng, errors = np.random.default_rng(0), {}
    T = len(ids)
    for layer, c in zip(model.model.layers, cache):
        k = c.keys[:, :, :T].astype(mx.float32)  # (1, H, T, d), after RoPE
        d = k.shape[-1]
        frame = frame_of(layer.self_attn.rope, d)[0]
        mu = fit_mean(k[:, :, 1:1 + BLOCK], 1, frame)  # (after the sink, on the first block: as a cache fits it)
        x = k - rotate(mx.broadcast_to(mu[None, :, None, :], k.shape), mx.arange(T)[None, None, :], frame)
        pi = np.linalg.qr(rng.standard_normal((d, d)))[0]
        y = np.array(x)[0, :, 1:] @ pi.T  # (H, T - 1, d)
        for h in range(y.shape[0]):
            block_errors(y[h], errors)
    rows = [{"variant": n, "relative_squared_error": float(np.mean(v)), "blocks": len(v)} for n, v in errors.items()]
    print(f"{name}, {T} tokens, {len(model.model.layers)} layers: key error per 128-token block (4-bit levels)")
    print("| variant | relative squared error | blocks |\n|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['relative_squared_error']:.5f} | {r['blocks']} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": name, "tokens": T, "text": None if args.smoke else args.text_file, "rows": rows}, f,
                  indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
