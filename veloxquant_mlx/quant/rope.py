"""RoPE as a per-pair rotation: what the key offset (``CacheOptions.rope_offset``) needs of a layer's RoPE.

A RoPE module (mlx.nn.RoPE, mlx_lm's ``rope_utils`` variants) rotates each pair of channels ``p`` of a head by the
angle ``t * rates[p]`` at position ``t``: ``R_t``, with ``R_{s+t} = R_s R_t`` and ``R_t^T = R_{-t}``. `RopeFrame`
is that rotation as data (rates, rotated dims, pair layout), read off a module by `frame_of` (which checks the
module is one: a variant that also scales its input, as YaRN's ``mscale`` does, is not, and stays unread), so a
cache can hold it in its options and saved states. Pure functions of arrays; nothing here knows about caches.

The offset (issue 54): keys after RoPE are ``k_t = R_t (mu + r_t)``, ``mu`` a per-head mean before RoPE; coding
``k_t - R_t mu`` leaves the per-token part, and attention adds ``q . R_t mu`` back (`offset_scores`: per block of
tokens ``R_{s0+j} = R_{s0} R_j``, so ``q . R_{s0+j} mu = (R_{-s0} q) . (R_j mu)``: one small matmul).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

# `offset_scores`: tokens per block of the factorization (R_j mu is computed for j < this).
OFFSET_BLOCK = 128


@dataclass(frozen=True)
class RopeFrame:
    """A per-pair rotation: pair ``p`` of the first ``dims`` channels turns by ``t * rates[p]`` at position ``t``.

    ``traditional``: pairs are channels ``(2p, 2p + 1)`` (else ``(p, p + dims/2)``, mlx_lm's default layout);
    channels from ``dims`` on are not rotated."""

    dims: int
    traditional: bool
    rates: Tuple[float, ...]

    def __post_init__(self):
        if not isinstance(self.dims, int) or isinstance(self.dims, bool) or self.dims < 2 or self.dims % 2:
            raise ValueError(f"RopeFrame dims must be an even int >= 2, got {self.dims!r}")
        if not isinstance(self.traditional, bool):
            raise TypeError(f"RopeFrame traditional must be a bool, got {type(self.traditional).__name__}")
        rates = tuple(float(r) for r in self.rates)
        if len(rates) != self.dims // 2 or not all(np.isfinite(rates)):
            raise ValueError(f"RopeFrame rates must be {self.dims // 2} finite floats (one per pair), got {len(rates)}")
        object.__setattr__(self, "rates", rates)

    def to_list(self) -> list:
        """JSON form: ``[dims, traditional, [rates...]]`` (floats of float32 values: exact in JSON)."""
        return [self.dims, self.traditional, list(self.rates)]

    @classmethod
    def from_list(cls, value) -> "RopeFrame":
        if isinstance(value, RopeFrame):
            return value
        if not (isinstance(value, (list, tuple)) and len(value) == 3 and isinstance(value[2], (list, tuple))):
            raise ValueError(f"key_rope must be [dims, traditional, [rates...]], got {value!r}")
        return cls(value[0], value[1], tuple(value[2]))


def _pairs(x: mx.array, frame: RopeFrame):
    """``(a, b, rest)``: the pairs' first and second channels ``(..., dims/2)`` and the unrotated channels."""
    d2 = frame.dims // 2
    rot, rest = x[..., :frame.dims], x[..., frame.dims:]
    if frame.traditional:
        pr = rot.reshape(rot.shape[:-1] + (d2, 2))
        return pr[..., 0], pr[..., 1], rest
    return rot[..., :d2], rot[..., d2:], rest


def _join(a: mx.array, b: mx.array, rest: mx.array, frame: RopeFrame) -> mx.array:
    if frame.traditional:
        rot = mx.stack([a, b], axis=-1).reshape(a.shape[:-1] + (frame.dims,))
    else:
        rot = mx.concatenate([a, b], axis=-1)
    if not rest.shape[-1]:
        return rot
    return mx.concatenate([rot, mx.broadcast_to(rest, rot.shape[:-1] + rest.shape[-1:])], axis=-1)


def turns(positions: mx.array, frame: RopeFrame) -> Tuple[mx.array, mx.array]:
    """``(cos, sin)`` ``(..., n, dims/2)`` of the angles ``t * rates`` at ``positions`` ``(..., n)``."""
    angles = mx.expand_dims(positions.astype(mx.float32), -1) * mx.array(frame.rates, dtype=mx.float32)
    return mx.cos(angles), mx.sin(angles)


def rotate(x: mx.array, positions: mx.array, frame: RopeFrame, cs=None) -> mx.array:
    """``R_t x`` float32: ``x`` ``(..., n, d)``, ``positions`` int (or float) broadcastable to ``(..., n)`` (negative
    positions rotate back: ``R_{-t} = R_t^T``); ``cs``: their `turns`, when already known (``positions`` unread)."""
    x = x.astype(mx.float32)
    c, s = turns(positions, frame) if cs is None else cs
    a, b, rest = _pairs(x, frame)
    return _join(a * c - b * s, a * s + b * c, rest, frame)


def frame_of(rope, head_dim: int) -> Tuple[Optional[RopeFrame], str]:
    """``(RopeFrame, "")`` of a RoPE module called as ``rope(x, offset=t)`` on ``(B, H, L, head_dim)``, or
    ``(None, why)``: its rotation at position 1 gives each pair's rate, and the module must then agree with
    `rotate` at positions 0, 3, 100 and 5000 on random vectors (an input scale, a non-rotation, an unknown layout:
    refused)."""
    d = int(head_dim)
    try:
        eye = mx.eye(d, dtype=mx.float32).reshape(d, 1, 1, d)
        m1 = np.array(rope(eye, offset=1).astype(mx.float32)).reshape(d, d)  # row j: R_1 e_j
    except Exception as e:  # noqa: BLE001 - any module we cannot call this way is one we do not read
        return None, f"{type(rope).__name__} cannot be called as rope(x, offset=t) ({type(e).__name__})"
    moved = np.abs(m1 - np.eye(d)).max(axis=1) > 1e-6
    dims = int(getattr(rope, "dims", 0) or 0)
    if not (2 <= dims <= d and dims % 2 == 0):
        dims = int(np.nonzero(moved)[0].max()) + 1 if moved.any() else 0
        dims += dims % 2
    if dims < 2:
        return None, f"{type(rope).__name__} rotates no channel"
    traditional = bool(getattr(rope, "traditional", abs(m1[0, 1]) > abs(m1[0, dims // 2])))
    first = np.arange(0, dims, 2) if traditional else np.arange(dims // 2)
    second = first + 1 if traditional else first + dims // 2
    rates = np.arctan2(m1[first, second], m1[first, first]).astype(np.float32)
    try:
        frame = RopeFrame(dims, traditional, tuple(float(r) for r in rates))
    except ValueError as e:
        return None, str(e)
    x = mx.random.normal((1, 2, 3, d), key=mx.random.key(0))
    for t in (0, 3, 100, 5000):
        got = rope(x, offset=t).astype(mx.float32)
        want = rotate(x, mx.arange(t, t + 3), frame)
        err = float(mx.max(mx.abs(got - want)).item())
        if not err <= 1e-3 * max(float(mx.max(mx.abs(x)).item()), 1.0):
            return None, (f"{type(rope).__name__} is not a per-pair rotation of the keys (position {t}: "
                          f"{err:.2g} from one)")
    return frame, ""


def fit_mean(keys: mx.array, start, frame: RopeFrame) -> mx.array:
    """Per-head mean before RoPE ``(H, d)`` float32 of keys ``(1, H, n, d)`` after RoPE at positions
    ``start .. start + n`` (non-finite tokens left out, as the codecs' channel means do)."""
    n = keys.shape[2]
    back = rotate(keys, -(mx.arange(n) + start), frame)[0]  # (H, n, d)
    ok = mx.all(mx.isfinite(back), axis=-1, keepdims=True)
    count = mx.maximum(mx.sum(ok, axis=1), 1)
    return mx.sum(mx.where(ok, back, 0.0), axis=1) / count


def offset_keys(mu: mx.array, starts: mx.array, n: int, frame: RopeFrame) -> mx.array:
    """``R_t mu`` ``(G, n, d)`` float32 at positions ``starts[g] + j``: ``mu`` ``(G, d)``, ``starts`` ``(G,)``."""
    tiled = mx.broadcast_to(mu[:, None, :], (mu.shape[0], n, mu.shape[-1]))
    return rotate(tiled, starts.reshape(-1, 1) + mx.arange(n), frame)


def offset_scores(q: mx.array, mu: mx.array, starts: mx.array, n: int, frame: RopeFrame,
                  memo: Optional[dict] = None) -> mx.array:
    """``q . R_t mu`` ``(G, M, n)`` float32 for queries ``q`` ``(G, M, d)`` on tokens at positions
    ``starts[g] + j``, ``j < n``: per block of `OFFSET_BLOCK` tokens ``(R_{-s0} q) . (R_j mu)`` (one matmul).
    ``memo``: a dict kept while ``mu`` and ``starts`` stay (what depends on them alone is computed once)."""
    G, M, d = q.shape
    blk = OFFSET_BLOCK  # (whole blocks, sliced: a growing part keeps its tables until it needs one more block)
    nb = max(-(-n // blk), 1)
    memo = {} if memo is None else memo
    key = (blk, nb)
    if key not in memo:
        if len(memo) > 4:
            memo.clear()
        s0 = starts.reshape(G, 1, 1) + (mx.arange(nb) * blk).reshape(1, nb, 1)  # (G, nb, 1)
        cs = turns(-s0, frame)  # (G, nb, 1, dims/2): broadcast over the M queries
        u = mx.swapaxes(offset_keys(mu, mx.zeros((G,), dtype=mx.int32), blk, frame), -1, -2)  # (G, d, blk)
        memo[key] = (cs, u)
    (c, s_), u = memo[key]
    s = _block_scores(frame.dims, frame.traditional)(q, c, s_, u)  # (G, M, nb*blk)
    return s[..., :n] if nb * blk != n else s


@functools.lru_cache(maxsize=None)
def _block_scores(dims: int, traditional: bool):
    """``(q, cos, sin, u) -> (G, M, nb*blk)``: each block's ``R_{-s0} q`` dotted with ``u`` = ``R_j mu``
    ``(G, d, blk)``, fused by ``mx.compile`` (a decode step runs it per layer: one kernel, not ~15 small ops)."""
    frame = RopeFrame(dims, traditional, (0.0,) * (dims // 2))  # (the layout only: the angles come as cos / sin)

    def scores(q, c, s, u):
        G, M, d = q.shape
        nb, blk = c.shape[1], u.shape[-1]
        qr = rotate(q[:, None], None, frame, (c, s))  # (G, nb, M, d)
        out = qr.reshape(G, nb * M, d) @ u  # (G, nb*M, blk)
        return mx.swapaxes(out.reshape(G, nb, M, blk), 1, 2).reshape(G, M, nb * blk)

    return mx.compile(scores)


__all__ = ["OFFSET_BLOCK", "RopeFrame", "fit_mean", "frame_of", "offset_keys", "offset_scores", "rotate", "turns"]
