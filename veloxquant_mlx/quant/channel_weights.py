"""Static channel weights: code ``w * k`` and score with ``q / w`` (keys), code ``w * v`` and divide the output by
``w`` (values). Pure functions of ``(heads, d)`` statistics.

Attention needs ``q . k``, not ``k``: ``q . k = (q / w) . (w * k)`` for any positive per-channel ``w``. A rotated
code spreads its error evenly over the rotated coordinates, with a size proportional to the energy of what it
codes, so the expected squared score error of keys coded as ``w * k`` is proportional to

    sum_j w_j^2 K_j  *  sum_j Q_j / w_j^2        (K_j: key variance of channel j, Q_j: queries' second moment)

which Cauchy-Schwarz minimises at ``w_j^4 = Q_j / K_j`` (``power=0.25``). The same argument weights values by the
output projection's squared column norms ``O_j`` against their second moments ``V_j``.

Weights are rounded to powers of two: multiplying and dividing by them is exact in floating point (barring
overflow), so a token held exact stays bit-identical through the weighting; they are centred to a geometric mean
of 1 per head and clipped to ``[2**-MAX_LOG2, 2**MAX_LOG2]`` (a bound on what a float16 exact token can gain).
"""
from __future__ import annotations

import mlx.core as mx

MAX_LOG2 = 3  # weights within [1/8, 8]
TINY = 1e-12


def channel_weights(importance: mx.array, energy: mx.array, power: float = 0.25) -> mx.array:
    """Per-channel power-of-two weights ``(heads, d)`` float32 from ``importance`` (what multiplies the error:
    the queries' second moments for keys, the output projection's squared column norms for values) and
    ``energy`` (what is coded: variances or second moments), both ``(heads, d)``."""
    if importance.shape != energy.shape or importance.ndim != 2:
        raise ValueError(f"importance and energy must both be (heads, d), got {tuple(importance.shape)} and "
                         f"{tuple(energy.shape)}")
    ratio = mx.maximum(importance.astype(mx.float32), TINY) / mx.maximum(energy.astype(mx.float32), TINY)
    log_w = power * mx.log2(ratio)
    log_w = log_w - mx.mean(log_w, axis=-1, keepdims=True)  # geometric mean 1: the weights only redistribute
    return mx.power(2.0, mx.round(mx.clip(log_w, -MAX_LOG2, MAX_LOG2)))


def unrotated_score_error(query_power: mx.array, key_variance: mx.array) -> mx.array:
    """``(heads,)``: the attention-score error of keys coded per channel in the model's own channels, relative to
    the same codes after a random rotation, predicted from ``(heads, d)`` second moments. A rotation spreads every
    channel's coding error evenly, so the error of ``q . k`` goes as ``sum(E[q^2]) * sum(var) / d``; without one
    each channel keeps its own, ``sum(E[q_c^2] * var_c)``. Below 1: the queries read mostly channels whose keys
    vary little, and a rotation would pour the other channels' error into them."""
    if query_power.shape != key_variance.shape or query_power.ndim != 2:
        raise ValueError(f"query_power and key_variance must both be (heads, d), got {tuple(query_power.shape)} "
                         f"and {tuple(key_variance.shape)}")
    qp, kv = query_power.astype(mx.float32), key_variance.astype(mx.float32)
    d = qp.shape[-1]
    return d * (qp * kv).sum(axis=-1) / mx.maximum(qp.sum(axis=-1) * kv.sum(axis=-1), TINY)


def is_power_of_two(w: mx.array) -> bool:
    """Whether every entry of ``w`` is a finite power of two within the clipping range."""
    lw = mx.log2(w.astype(mx.float32))
    return bool(mx.all(mx.isfinite(lw) & (lw == mx.round(lw)) & (mx.abs(lw) <= MAX_LOG2)).item())
