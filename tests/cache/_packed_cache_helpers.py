"""Helpers, fixtures and constants shared by `test_packed_cache.py` and `test_packed_cache_layouts.py`."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.cache.options import CacheOptions

CODE_BATCH = CacheOptions().code_batch  # the default

D = 16


def cfg(**kw):
    kw.setdefault("bit_width_inlier", 4)
    return KVCacheConfig(**kw)


def kv(B=1, H=2, T=8, d=D, seed=0, offset=0.0, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((B, H, T, d)).astype(np.float32) + offset
    v = rng.standard_normal((B, H, T, d)).astype(np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def rel_err(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def assert_same_stored_tokens(a, b, rest, chunks):
    """``rest`` (keys, values) into ``a`` in one call and into ``b`` in ``chunks``: same history fetched."""
    whole = a.update_and_fetch(*rest)
    start = 0
    for T in chunks:
        got = b.update_and_fetch(rest[0][:, :, start : start + T], rest[1][:, :, start : start + T])
        start += T
    assert mx.allclose(whole[0], got[0], atol=1e-6) and mx.allclose(whole[1], got[1], atol=1e-6)


# -- the rotating cache behaves like mlx_lm's RotatingKVCache ------------------------------------------
def attend(cache, q, k, v):
    """One attention call through a cache, with the mask the cache itself makes (as mlx_lm models do)."""
    mask = cache.make_mask(q.shape[2], window_size=None)
    keys, values = cache.update_and_fetch(k, v)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask)


# -- codec="affine_block": keys coded in whole blocks of tokens, K^T layout ----------------------------
DB = 32  # head dim for the affine codecs (their groups are 32, 64 or 128 wide); block = 32 tokens here


def block_cache(**kw):
    kw.setdefault("codec", "affine_block")
    return TurboQuantPackedCache(cfg(), **kw)


# ----------------------------------------------------------------------------- issue 47: a coded tail
def _budget(bits=4, codec="kblock_vsym8_pt"):
    """Issue 47's budget layout at ``bits`` (the presets' block layout before issue 54, `KBLOCK`)."""
    import dataclasses

    from _layouts import KBLOCK

    return dataclasses.replace(KBLOCK, codec=codec, k_bits=bits, v_bits=bits)
