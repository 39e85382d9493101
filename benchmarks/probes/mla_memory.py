"""Bytes per token of one MLA layer (DeepSeek-V3 / Kimi K2 shape: the cache holds a 512-wide latent as "keys" and
the 64-wide RoPE part as "values", one head) in mlx_lm's caches and ours, filled as a chunked prefill does.

    python -m benchmarks.probes.mla_memory [--tokens 4096] [--chunk 512] [--out results/mla_memory.json]

Every stored byte counted (`veloxquant_mlx.eval.memory.stored_nbytes`), at a round token count; the latent's and
the RoPE part's relative reconstruction error (what the layer rebuilds its keys and values from) beside it. The
latent is drawn from a normal distribution (a real model's would need its weights, which cannot be downloaded
here): bytes do not depend on it, the errors are indicative only.
"""
from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from veloxquant_mlx.eval.memory import stored_nbytes

from benchmarks import _common

LATENT, ROPE = 512, 64  # kv_lora_rank, qk_rope_head_dim of DeepSeek-V3


def fill(cache, latent, rope, chunk):
    """Store the tokens ``chunk`` at a time; returns what the last fetch handed out (the whole history)."""
    out = None
    for s in range(0, latent.shape[2], chunk):
        out = cache.update_and_fetch(latent[:, :, s:s + chunk], rope[:, :, s:s + chunk])
        mx.eval(out)
    return out


def rel_error(a, b) -> float:
    return float(mx.linalg.norm((a.astype(mx.float32) - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1)))


def main(argv=None) -> int:
    p = _common.parser(__doc__, brief=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512)
    _common.add_out(p)
    a = p.parse_args(argv)
    if a.tokens < 1 or a.chunk < 1:
        p.error("--tokens and --chunk must be positive")
    mx.random.seed(0)
    latent = mx.random.normal((1, 1, a.tokens, LATENT))
    rope = mx.random.normal((1, 1, a.tokens, ROPE))
    rows = []
    configs = [
        ("mlx_lm KVCache float32", lambda: KVCache(), mx.float32),
        ("mlx_lm KVCache bfloat16", lambda: KVCache(), mx.bfloat16),
        ("mlx_lm QuantizedKVCache 8-bit", lambda: QuantizedKVCache(group_size=64, bits=8), mx.bfloat16),
        ("mlx_lm QuantizedKVCache 4-bit", lambda: QuantizedKVCache(group_size=64, bits=4), mx.bfloat16),
        ("veloxquant default (tq-affine-k8v4)", lambda: TurboQuantPackedCache(fetch_placeholders=False), mx.bfloat16),
        ("veloxquant tq-4b", lambda: TurboQuantPackedCache("tq-4b", fetch_placeholders=False), mx.bfloat16),
    ]
    for name, make, dtype in configs:
        cache = make()
        got = fill(cache, latent.astype(dtype), rope.astype(dtype), a.chunk)
        if isinstance(cache, QuantizedKVCache):  # (mlx_lm hands out its codes: decode them to compare)
            got = tuple(mx.dequantize(*x, group_size=cache.group_size, bits=cache.bits) for x in got)
        nbytes = stored_nbytes(cache)
        rows.append({"cache": name, "dtype": str(dtype), "bytes_per_token": nbytes / a.tokens,
                     "latent_error": rel_error(got[0][:, :, :a.tokens], latent),
                     "rope_error": rel_error(got[1][:, :, :a.tokens], rope)})
    base = next(r for r in rows if r["cache"] == "mlx_lm KVCache bfloat16")["bytes_per_token"]
    print(f"MLA layer (latent {LATENT} + RoPE {ROPE}, 1 head), {a.tokens} tokens in chunks of {a.chunk}")
    print(f"{'cache':38s} {'bytes/token':>11s} {'vs bf16':>8s} {'latent err':>10s} {'rope err':>9s}")
    for r in rows:
        r["vs_bfloat16"] = r["bytes_per_token"] / base
        print(f"{r['cache']:38s} {r['bytes_per_token']:11.1f} {r['vs_bfloat16']:8.3f} {r['latent_error']:10.4f} "
              f"{r['rope_error']:9.4f}")
    if a.out:
        _common.write_json(a.out, {"tokens": a.tokens, "chunk": a.chunk, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
