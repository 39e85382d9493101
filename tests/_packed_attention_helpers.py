"""Helpers and constants shared by tests/attention/test_packed_sdpa.py, tests/cache/test_face.py and
tests/codecs/test_affine_codec_checks.py (the affine codecs): random arrays, codecs, coded histories, masks."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask

from veloxquant_mlx.codecs import AffineBlockKeyCodec, AffineRotatedCodec, LloydMaxCodec

D = 64
SINK, RECENT = 3, 4


def rand(shape, seed, offset=0.0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) + offset)


def make_codecs(kind: str, d: int = D):
    if kind.startswith("block"):  # block-layout keys, per-token affine values
        bits = int(kind[len("block"):])
        return AffineBlockKeyCodec(d, bits, seed=1), AffineRotatedCodec(d, bits, seed=2)
    if kind.startswith("affine"):
        bits = int(kind[len("affine"):])
        return AffineRotatedCodec(d, bits, seed=1), AffineRotatedCodec(d, bits, seed=2)
    method, _, outl = kind.partition("+")
    n_out = 8 if outl else 0
    return (LloydMaxCodec(f"turboquant_{method}", d, 3, seed=1, n_outliers=n_out),
            LloydMaxCodec(f"turboquant_{method}", d, 3, seed=2, n_outliers=n_out))


def setup(kind, B=2, Hkv=2, n=None, window=True, seed=0, d=D):
    """Coded history (keys with a channel offset, so centering matters) + optional exact window."""
    kc, vc = make_codecs(kind, d)
    n = n or (2 * kc.token_block if hasattr(kc, "token_block") and kc.token_block > 1 else 24)
    K, V = rand((B, Hkv, n, d), seed, offset=0.7), rand((B, Hkv, n, d), seed + 1, offset=-0.2)
    kc.fit(K)
    vc.fit(V)
    ka, va = kc.encode(K), vc.encode(V)
    sink = (rand((B, Hkv, SINK, d), seed + 2), rand((B, Hkv, SINK, d), seed + 3)) if window else None
    recent = (rand((B, Hkv, RECENT, d), seed + 4), rand((B, Hkv, RECENT, d), seed + 5)) if window else None
    ks, vs = [kc.decode(ka, mx.float32)], [vc.decode(va, mx.float32)]
    if window:
        ks, vs = [sink[0]] + ks + [recent[0]], [sink[1]] + vs + [recent[1]]
    return kc, ka, vc, va, sink, recent, mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)


def mask_for(kind, B, Hq, L, N, seed=0):
    """(mask given to ours, explicit mask array for the reference)."""
    if kind == "none":
        return None, None
    if kind == "causal":
        return "causal", create_causal_mask(L, N - L)
    if kind == "window":
        m = create_causal_mask(L, N - L, window_size=7)
        return m, m
    if kind == "bool":
        m = mx.array(np.random.default_rng(seed).random((B, 1, L, N)) > 0.3)
        m = m | (mx.arange(N) == N - 1)  # every query sees at least one key (SDPA is undefined otherwise)
        return m, m
    if kind == "additive":
        m = mx.array(np.random.default_rng(seed).standard_normal((B, Hq, L, N)).astype(np.float32))
        return m, m
    raise ValueError(kind)


def assert_close(out, ref):
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-3, atol=1e-4)


def banded_sdpa_reference(cache, q, keys, values, scale, mask):
    """SDPA on the decoded history ``(B, H, N, d)``, where a chunk's query reads each of its ``recent`` newest keys
    from the exact copies the cache took of the chunk (``_band``: the history's last M tokens), as decoding the
    tokens one at a time would have had them."""
    band, L, N = getattr(cache, "_band", None), q.shape[2], keys.shape[2]
    if band is None or L == 1 or not cache.rows.options.recent:
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    bk, bv = (mx.concatenate([b[j] for b in band], axis=0).astype(mx.float32) for j in (0, 1))  # rows in lockstep
    M, R = bk.shape[2], q.shape[1] // keys.shape[1]
    rep = lambda x: mx.repeat(x, R, axis=1)  # noqa: E731  (B, Hq, n, d)
    q_pos, k_pos = mx.arange(N - L, N)[:, None], mx.arange(N)[None, :]
    from_copy = (k_pos >= N - M) & (q_pos - k_pos < cache.rows.options.recent)  # (L, N)
    pad = lambda x: mx.concatenate([mx.zeros(x.shape[:2] + (N - M, x.shape[3])), x], axis=2)  # noqa: E731
    s_dec, s_copy = (rep(k) @ mx.swapaxes(q, -1, -2) for k in (keys, pad(bk)))  # (B, Hq, N, L)
    s = mx.where(from_copy, mx.swapaxes(s_copy, -1, -2), mx.swapaxes(s_dec, -1, -2)) * scale  # (B, Hq, L, N)
    visible = q_pos >= k_pos if isinstance(mask, str) else (mask if mask is not None else None)
    if visible is not None:
        s = mx.where(visible, s, -mx.inf) if visible.dtype == mx.bool_ else s + visible
    w = mx.softmax(s, axis=-1)
    return (w * ~from_copy) @ rep(values) + (w * from_copy) @ rep(pad(bv))
