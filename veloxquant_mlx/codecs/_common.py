"""Small pieces every codec file shares: per-token token-axis bookkeeping and the CPU crossover rule."""
from __future__ import annotations

import threading
from typing import Dict, Optional, Sequence

import mlx.core as mx
import numpy as np

TOKEN_AXIS = 2


def f32(x: mx.array) -> mx.array:
    """``x`` as float32, without adding a graph node when it already is (decode builds ~60 ops per layer)."""
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def packed_matmul_ok(rows: int, packed_rows: Optional[int], cpu_crossover: int) -> bool:
    """Whether ``rows`` query rows per KV head should use quantized matmuls (else dequantize once + BLAS).

    On CPU `mx.quantized_matmul` costs grow linearly with the rows while dequantize + BLAS costs ~O(n d)
    whatever the rows: each layout measured its own crossover. GPUs tile large row counts: always packed.
    """
    if packed_rows is not None:
        return rows <= packed_rows
    return rows <= cpu_crossover or mx.default_device() != mx.cpu  # (the device is asked only for long chunks)


def finite_channel_mean(x: mx.array) -> mx.array:
    """Per-head channel mean ``(H, d)`` float32 of ``(B, H, T, d)`` over finite entries only: one NaN or inf
    coordinate in one token must not poison the statistics every later token is coded with."""
    mean = mx.mean(x, axis=(0, 2))  # the plain mean wherever a channel is all finite (bit-exact as before)
    ok = mx.isfinite(x)
    finite = mx.sum(mx.where(ok, x, 0.0), axis=(0, 2)) / mx.maximum(mx.sum(ok.astype(mx.float32), axis=(0, 2)), 1.0)
    return mx.where(mx.isfinite(mean), mean, finite)


def check_codable(parts: Dict[str, Sequence[mx.array]], first: int, codec: str, block: int) -> None:
    """ValueError naming the argument (``keys`` / ``values``) when the tokens a cache is about to code per channel
    over blocks hold a non-finite value: a block's one scale and bias per channel cannot hold it alone (it would
    spread over the block, or be hidden). ``parts``: per argument, the ``(B, H, n, d)`` arrays of those tokens in
    temporal order, the first at token ``first`` of the cache. One host sync for all of them."""
    flags = [mx.all(mx.isfinite(a)) for arrays in parts.values() for a in arrays]
    if all(mx.stack(flags).tolist()):
        return
    from veloxquant_mlx.codecs import CODECS

    for name, arrays in parts.items():
        rows = np.concatenate([np.array(a.astype(mx.float32)) for a in arrays], axis=2)
        bad = np.nonzero(~np.isfinite(rows).all(axis=(0, 1, 3)))[0]
        if len(bad):
            at = ", ".join(str(first + int(i)) for i in bad[:8]) + (", ..." if len(bad) > 8 else "")
            per_token = tuple(n for n, lay in CODECS.items() if not (lay.keys.BLOCKED or lay.values.BLOCKED))
            raise ValueError(
                f"{name} hold a non-finite value (inf or NaN) at token{'s' if len(bad) > 1 else ''} {at} of this "
                f"cache, which this update would code: codec={codec!r} stores {name} per channel over blocks of "
                f"{block} tokens with one scale and bias each, where a non-finite token would spread over its block "
                f"or be hidden. Non-finite {name} usually mean the model overflowed (float16 activations): run it in "
                f"bfloat16 or float32, or use a per-token codec {per_token}, which keeps such a token to itself. The "
                "cache is unchanged.")

FLOAT16_MAX = 65504.0


def _to_float16(*xs: mx.array):
    # Finite values beyond the range clamp to it; +-inf and NaN stay as they are (a non-finite input stays visible).
    return tuple(mx.where(mx.isinf(x), x, mx.clip(x, -FLOAT16_MAX, FLOAT16_MAX)).astype(mx.float16) for x in xs)


# One fused kernel instead of seven operations per array (two scalar broadcasts, maximum, minimum, isinf, where,
# cast): a cache stores scales and biases this way at every coded block, and each operation costs ~10 us on CPU
# whatever its size. Elementwise only, so one shapeless trace serves every shape (per number of arguments).
_to_float16_fused = mx.compile(_to_float16, shapeless=True)
_fused_lock = threading.Lock()  # tracing fills the compiled function's cache


def clamp_to(x: mx.array, dtype) -> mx.array:
    """float32 ``x`` in ``dtype``, clamped to float16's finite range when that is the target: a reconstruction
    may overshoot an input near ±65504 and must not decode to inf. ±inf and NaN pass unchanged: a non-finite
    input (or scale) must stay non-finite, never become a finite ±65504."""
    if dtype == mx.float16:
        return clamp_all_to(dtype, x)[0]
    return x.astype(dtype)


def clamp_all_to(dtype, *xs: mx.array) -> tuple:
    """`clamp_to` of every array of ``xs`` (float16: one fused kernel for all of them)."""
    if dtype != mx.float16:
        return tuple(x.astype(dtype) for x in xs)
    with _fused_lock:
        return _to_float16_fused(*xs)


class PerTokenLayout:
    """Mixin for layouts whose arrays all hold the token axis at 2 (``(B, H, n, ...)``)."""

    token_block = 1
    BLOCKED = False  # codes single tokens: a cache may evict or trim any one

    def n_tokens(self, codes: Dict[str, mx.array]) -> int:
        return next(iter(codes.values())).shape[TOKEN_AXIS] if codes else 0

    def slice_tokens(self, codes: Dict[str, mx.array], start: int, stop: int) -> Dict[str, mx.array]:
        return {f: a[:, :, start:stop] for f, a in codes.items()}

    def concat(self, chunks: Sequence[Dict[str, mx.array]]) -> Dict[str, mx.array]:
        chunks = [c for c in chunks if c]
        if len(chunks) == 1:
            return dict(chunks[0])
        return {f: mx.concatenate([c[f] for c in chunks], axis=TOKEN_AXIS) for f in chunks[0]}

    def new_store(self, step: int):
        from veloxquant_mlx.cache._token_store import TokenStore

        return TokenStore(step)

    def check_codes(self, codes: Dict[str, mx.array], name: str) -> None:
        """The fields `encode` writes, sharing (B, H, n) (what a restore must find)."""
        expected = self.code_fields()
        missing = sorted(set(expected) - set(codes))
        extra = sorted(set(codes) - set(expected))
        if missing or extra:
            raise ValueError(f"{name}: stored code arrays {sorted(codes)} do not match this codec's "
                             f"{sorted(expected)} (missing {missing}, unexpected {extra})")
        lead = {tuple(a.shape[:3]) for a in codes.values()}
        if len(lead) != 1:
            raise ValueError(f"{name}: code arrays disagree on (B, H, tokens): {sorted(lead)}")
        for f, a in codes.items():
            trailing, dtype = expected[f]
            if a.ndim != 3 + len(trailing) or tuple(a.shape[3:]) != trailing or a.dtype != dtype:
                want = ", ".join(["B", "H", "n"] + [str(t) for t in trailing])
                raise ValueError(f"{name}: array {f!r} has shape {tuple(a.shape)} {a.dtype}, expected ({want}) {dtype}")

    def code_fields(self) -> Dict[str, tuple]:
        """``{field: (shape after (B, H, n), dtype)}`` of what `encode` writes (probed once on a zero token)."""
        fields = getattr(self, "_code_fields", None)
        if fields is None:
            probe = self.encode(mx.zeros((1, 1, 1, self.d), dtype=mx.float32))
            fields = self._code_fields = {f: (tuple(a.shape[3:]), a.dtype) for f, a in probe.items()}
        return fields
