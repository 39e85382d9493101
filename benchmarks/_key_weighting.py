"""Query-aware channel weighting of keys (and output-aware weighting of values) before quantization.

Attention only needs ``q . k``, not ``k``. For any invertible per-head matrix ``A``,

    q . k = (A^-T q) . (A k),

so a cache may store the codes of ``k' = A k`` and either decode ``k = A^-1 k'_hat`` or score with
the transformed query ``A^-T q``: scores are unchanged when nothing is quantized. With a rotated
quantizer the error ``e'`` on ``k'`` is close to isotropic with a size proportional to ``||k'||``,
so the score error is ``q . A^-1 e'`` and its expected square is proportional to

    tr(A Sigma_k A^T) * tr(A^-T Sigma_q A^-1)        (Sigma_k: centred keys, Sigma_q: queries).

For a diagonal ``A = diag(w)`` the minimum (Cauchy-Schwarz) is at ``w_i^4 ∝ E[q_i^2] / E[k_i^2]``; for a
full matrix it is at ``A^T A = Sigma_k^-1 # Sigma_q`` (the matrix geometric mean). The same argument with
``Sigma_q`` replaced by the output projection's Gram matrix ``W_o^T W_o`` weights values.

RoPE: keys are cached after RoPE. A diagonal weight that is equal on the two channels of each RoPE
pair is a multiple of the identity on that pair's plane, so it commutes with every RoPE rotation and the
weighting is position-independent. :func:`tie_rope_pairs` enforces that.

Everything here is pure MLX math on ``(..., d)`` arrays; no cache or model plumbing.
"""
from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx

_FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _check_float(name: str, x, min_ndim: int = 1) -> mx.array:
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    if x.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(x.shape)}")
    return x.astype(mx.float32)


def _check_even_dim(name: str, d: int) -> None:
    if d < 2 or d % 2:
        raise ValueError(f"{name} last axis must be an even head_dim >= 2 (RoPE pairs), got {d}")


# -- statistics ----------------------------------------------------------------------------------------
def tie_rope_pairs(m: mx.array, traditional: bool = True) -> mx.array:
    """Average a per-channel quantity ``(..., d)`` over each RoPE pair (both channels get the mean).

    ``traditional=True``: pairs are channels ``(2j, 2j+1)`` (mlx ``rope(traditional=True)``);
    ``False``: pairs are ``(j, j + d/2)`` (the half-split layout).
    """
    m = _check_float("m", m)
    d = m.shape[-1]
    _check_even_dim("m", d)
    if not isinstance(traditional, bool):
        raise TypeError(f"traditional must be a bool, got {type(traditional).__name__}")
    lead = m.shape[:-1]
    if traditional:
        pairs = m.reshape(*lead, d // 2, 2)
        avg = mx.mean(pairs, axis=-1, keepdims=True)
        return mx.broadcast_to(avg, pairs.shape).reshape(*lead, d)
    halves = m.reshape(*lead, 2, d // 2)
    avg = mx.mean(halves, axis=-2, keepdims=True)
    return mx.broadcast_to(avg, halves.shape).reshape(*lead, d)


def query_second_moments(queries: mx.array, n_kv_heads: int) -> mx.array:
    """``E[q_i^2]`` per KV head from captured queries ``(B, Hq, T, d)`` -> ``(n_kv_heads, d)``.

    The query heads of one GQA group (``Hq / n_kv_heads`` consecutive heads, mlx_lm's layout) all score
    the same keys, so their second moments are averaged.
    """
    q = _check_float("queries", queries, 4)
    hq, d = q.shape[1], q.shape[-1]
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int):
        raise TypeError(f"n_kv_heads must be an int, got {type(n_kv_heads).__name__}")
    if n_kv_heads < 1 or hq % n_kv_heads:
        raise ValueError(f"n_kv_heads must divide the {hq} query heads, got {n_kv_heads}")
    per_head = mx.mean(q * q, axis=(0, 2))  # (Hq, d)
    return mx.mean(per_head.reshape(n_kv_heads, hq // n_kv_heads, d), axis=1)


def query_second_moments_from_weights(
    w_q: mx.array, n_kv_heads: int, head_dim: int, input_scale: Optional[mx.array] = None
) -> mx.array:
    """Data-free ``E[q_i^2]`` per KV head from the query projection ``w_q`` ``(Hq * d, hidden)``.

    Assumes the projection input has uncorrelated unit-variance channels scaled by ``input_scale``
    ``(hidden,)`` (e.g. the RMSNorm weight), so ``E[q_i^2] = sum_j w_q[i, j]^2 scale_j^2``. Pre-RoPE; tie
    the pairs with :func:`tie_rope_pairs` to make it valid after RoPE. Returns ``(n_kv_heads, d)``.
    """
    w = _check_float("w_q", w_q, 2)
    if w.ndim != 2:
        raise ValueError(f"w_q must have shape (n_heads * head_dim, hidden), got {tuple(w.shape)}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1 or w.shape[0] % head_dim:
        raise ValueError(f"head_dim must be a positive int dividing {w.shape[0]}, got {head_dim!r}")
    if input_scale is not None:
        s = _check_float("input_scale", input_scale)
        if s.shape != (w.shape[1],):
            raise ValueError(f"input_scale must have shape ({w.shape[1]},), got {tuple(s.shape)}")
        w = w * s[None, :]
    rows = mx.sum(w * w, axis=1)  # (Hq * d,)
    hq = w.shape[0] // head_dim
    if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 1 or hq % n_kv_heads:
        raise ValueError(f"n_kv_heads must be a positive int dividing the {hq} query heads, got {n_kv_heads!r}")
    return mx.mean(rows.reshape(n_kv_heads, hq // n_kv_heads, head_dim), axis=1)


# -- diagonal weights ------------------------------------------------------------------------------------
def channel_weights(
    query_moments: mx.array,
    key_moments: Optional[mx.array] = None,
    q_power: float = 0.25,
    k_power: float = 0.25,
    traditional: bool = True,
    floor: float = 1e-6,
    tie: bool = True,
) -> mx.array:
    """Positive, RoPE-pair-tied per-channel key weights ``w`` ``(..., d)`` with geometric mean 1.

    ``w_i = E[q_i^2]^q_power / E[k_i^2]^k_power`` with both moments pair-averaged first. The defaults
    (1/4, 1/4) minimise the expected squared score error of an isotropic quantizer (module docstring);
    ``key_moments=None`` (or ``k_power=0``) gives the query-only weights ``E[q_i^2]^q_power``.
    ``floor`` (relative to each row's mean) keeps a dead channel from getting a zero or infinite weight.
    ``tie=False`` skips the pair averaging: scores stay exact (q and k are both post-RoPE), but the weight
    no longer commutes with RoPE, so post-RoPE statistics must be used.
    """
    tie_fn = tie_rope_pairs if tie else (lambda m, _t: _check_float("moments", m))
    q2 = tie_fn(query_moments, traditional)
    for name, p in (("q_power", q_power), ("k_power", k_power), ("floor", floor)):
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(p).__name__}")
    if not 0.0 <= q_power <= 1.0 or not 0.0 <= k_power <= 1.0:
        raise ValueError(f"q_power and k_power must be within [0, 1], got {q_power}, {k_power}")
    if not floor > 0:
        raise ValueError(f"floor must be > 0, got {floor}")

    def _floored(m):
        return mx.maximum(m, floor * mx.mean(m, axis=-1, keepdims=True) + 1e-30)

    logw = q_power * mx.log(_floored(q2))
    if key_moments is not None and k_power:
        k2 = tie_fn(key_moments, traditional)
        if k2.shape[-1] != q2.shape[-1]:
            raise ValueError(f"key_moments has d={k2.shape[-1]}, query_moments has d={q2.shape[-1]}")
        logw = logw - k_power * mx.log(_floored(k2))
    # geometric mean 1: the scale is irrelevant to a norm-separating quantizer, this keeps norms O(1)
    logw = logw - mx.mean(logw, axis=-1, keepdims=True)
    return mx.exp(logw)


def _check_weights(x: mx.array, w, name: str = "x") -> mx.array:
    w = _check_float("w", w)
    if w.shape[-1] != x.shape[-1]:
        raise ValueError(f"w has d={w.shape[-1]}, {name} has d={x.shape[-1]}")
    return w


def _heads_view(x: mx.array, w: mx.array) -> mx.array:
    """Broadcast per-head weights ``(H, d)`` against ``(B, H, T, d)``; ``(d,)`` is used as is."""
    if w.ndim == 2 and x.ndim == 4:
        if w.shape[0] != x.shape[1]:
            raise ValueError(f"w has {w.shape[0]} heads, x has {x.shape[1]} (shape (B, H, T, d))")
        return w[None, :, None, :]
    if w.ndim == 1:
        return w
    raise ValueError(f"w must have shape (d,) or (H, d) with x (B, H, T, d); got w {tuple(w.shape)}, x {tuple(x.shape)}")


def apply_channel_weights(x: mx.array, w: mx.array) -> mx.array:
    """``k' = w * k``: ``x`` ``(B, H, T, d)`` with ``w`` ``(H, d)`` (or ``(d,)``); float32 out."""
    xf = _check_float("x", x)
    return xf * _heads_view(xf, _check_weights(xf, w))


def unapply_channel_weights(x: mx.array, w: mx.array) -> mx.array:
    """Inverse of :func:`apply_channel_weights`: ``k = k' / w``."""
    xf = _check_float("x", x)
    return xf / _heads_view(xf, _check_weights(xf, w))


def weight_queries(queries: mx.array, w: mx.array) -> mx.array:
    """Queries ``(B, Hq, T, d)`` -> ``q / w`` so that ``(q / w) . (w k) = q . k`` (GQA: head ``h`` uses
    KV head ``h // (Hq / H)``). Lets attention score the weighted codes without unweighting every key."""
    q = _check_float("queries", queries, 4)
    w = _check_weights(q, w, "queries")
    if w.ndim == 2:
        hq, h = q.shape[1], w.shape[0]
        if hq % h:
            raise ValueError(f"w has {h} KV heads, which must divide the {hq} query heads")
        w = mx.repeat(w, hq // h, axis=0)
    return q / _heads_view(q, w)


# -- full-matrix transform ---------------------------------------------------------------------------------
def _sym_power(s: mx.array, p: float, eps: float) -> mx.array:
    """``S^p`` of symmetric PSD ``(..., d, d)`` via eigendecomposition (eigenvalues floored at eps * mean)."""
    vals, vecs = mx.linalg.eigh(s, stream=mx.cpu)
    floor = eps * mx.mean(vals, axis=-1, keepdims=True)
    vals = mx.maximum(vals, floor)
    return (vecs * (vals ** p)[..., None, :]) @ mx.swapaxes(vecs, -1, -2)


def geometric_mean_transform(
    sigma_q: mx.array, sigma_k: mx.array, eps: float = 1e-6
) -> Tuple[mx.array, mx.array]:
    """``(A, A^-1)``, each ``(..., d, d)``, with ``A^T A = Sigma_k^-1 # Sigma_q`` (matrix geometric mean).

    ``A`` is the symmetric square root, so ``k' = A k`` and ``q' = A^-1 q`` (A symmetric) keep
    ``q' . k' = q . k``. It is the full-covariance optimum of the score error; it does not commute with
    RoPE unless both covariances were averaged over positions (post-RoPE statistics).
    """
    sq = _check_float("sigma_q", sigma_q, 2)
    sk = _check_float("sigma_k", sigma_k, 2)
    if sq.shape != sk.shape or sq.shape[-1] != sq.shape[-2]:
        raise ValueError(f"sigma_q and sigma_k must be equal square (..., d, d), got {tuple(sq.shape)}, {tuple(sk.shape)}")
    sk_h = _sym_power(sk, 0.5, eps)
    sk_ih = _sym_power(sk, -0.5, eps)
    mid = _sym_power(sk_h @ sq @ sk_h, 0.5, eps)
    m = sk_ih @ mid @ sk_ih  # Sigma_k^-1 # Sigma_q, symmetric positive definite
    m = 0.5 * (m + mx.swapaxes(m, -1, -2))
    # normalise det(A) = 1 (scale is irrelevant to a norm-separating quantizer)
    vals, vecs = mx.linalg.eigh(m, stream=mx.cpu)
    vals = mx.maximum(vals, eps * mx.mean(vals, axis=-1, keepdims=True))
    vals = vals / mx.exp(mx.mean(mx.log(vals), axis=-1, keepdims=True))
    a = (vecs * mx.sqrt(vals)[..., None, :]) @ mx.swapaxes(vecs, -1, -2)
    a_inv = (vecs * (1.0 / mx.sqrt(vals))[..., None, :]) @ mx.swapaxes(vecs, -1, -2)
    return a, a_inv


def apply_transform(x: mx.array, a: mx.array) -> mx.array:
    """``x`` ``(B, H, T, d)`` -> ``x A^T`` per head with ``a`` ``(H, d, d)``: each vector becomes ``A x``."""
    xf = _check_float("x", x, 4)
    a = _check_float("a", a, 3)
    if a.shape != (xf.shape[1], xf.shape[-1], xf.shape[-1]):
        raise ValueError(f"a must have shape (H, d, d) = ({xf.shape[1]}, {xf.shape[-1]}, {xf.shape[-1]}), got {tuple(a.shape)}")
    return xf @ mx.swapaxes(a, -1, -2)[None]
