"""Small pieces every codec file shares: fitted-parameter plumbing (`FittedParams`), per-token token-axis
bookkeeping and layout (`PerTokenLayout`), and the CPU crossover rule."""
from __future__ import annotations

import copy
import threading
from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx

from veloxquant_mlx.codecs.contract import CodeField
from veloxquant_mlx.validate import check_heads

TOKEN_AXIS = 2
FittedSpec = Dict[str, Tuple[Tuple[int, ...], mx.Dtype]]  # name -> (shape, dtype) of a fit on `heads` heads


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


class FittedParams:
    """Mixin: the contract's fitting members through one code path. A codec defines

    - ``fitted_spec(heads) -> {name: (shape, dtype)}``: what a fit on ``heads`` heads gives (axis 0 = heads;
      default ``{}``: it fits nothing);
    - ``fitted_from(x) -> {name: array}``: the parameters of ``x`` ``(B, H, T, d)`` (pure: no state changes);

    and reads its parameters with ``fitted_param(name)`` (None before a fit). A codec that keeps them in its own
    attributes overrides ``_set_fitted(arrays)`` (validated arrays, ``{}`` = unfitted: rebind attributes, never
    write into arrays another codec object may share, since `with_fitted` shallow-copies) and `fitted_arrays`.
    """

    _params: Dict[str, mx.array] = {}  # rebound by `_set_fitted`, never written into

    def fitted_spec(self, heads: int) -> FittedSpec:
        return {}

    def fitted_from(self, x: mx.array) -> Dict[str, mx.array]:
        check_heads("x", x, self.d)
        return {}

    def _set_fitted(self, arrays: Dict[str, mx.array]) -> None:
        self._params = dict(arrays)

    def fitted_param(self, name: str) -> Optional[mx.array]:
        return self.fitted_arrays().get(name)

    def fitted_arrays(self) -> Dict[str, mx.array]:
        return dict(self._params)

    @property
    def fitted(self) -> bool:
        return not self.fitted_spec(1) or bool(self.fitted_arrays())

    def fit(self, x: mx.array) -> None:
        self._set_fitted(self.fitted_from(x))

    def check_fitted(self, arrays: Dict[str, mx.array]) -> Dict[str, mx.array]:
        """``arrays`` (a copy) when they are `fitted_spec`'s names, shapes (any number of heads) and dtypes, else
        ValueError naming the array. ``{}`` (unfitted) always passes."""
        arrays = dict(arrays)
        if not arrays:
            return arrays
        spec = self.fitted_spec(1)
        unexpected, missing = sorted(set(arrays) - set(spec)), sorted(set(spec) - set(arrays))
        if unexpected or missing:
            fits = f"fits {sorted(spec)}" if spec else "has no fitted arrays"
            raise ValueError(f"fitted arrays {sorted(arrays)} do not match this codec's: it {fits} (missing "
                             f"{missing}, unexpected {unexpected})")
        heads = None
        for name, (shape, dtype) in spec.items():
            a = arrays[name]
            if not isinstance(a, mx.array):
                raise ValueError(f"fitted array {name!r} must be an mx.array, got {type(a).__name__}")
            heads = a.shape[0] if heads is None and a.ndim else heads
            want = (heads,) + tuple(shape[1:])
            if tuple(a.shape) != want or a.dtype != dtype:
                raise ValueError(f"fitted array {name!r} has shape {tuple(a.shape)} {a.dtype}, expected "
                                 f"(H, {', '.join(map(str, shape[1:]))}) {dtype} per head"
                                 + (f" (H = {heads} from the other arrays)" if a.ndim and a.shape[0] != heads else ""))
        return arrays

    def load_fitted(self, arrays: Dict[str, mx.array]) -> None:
        self._set_fitted(self.check_fitted(arrays))

    def with_fitted(self, arrays: Dict[str, mx.array]):
        new = copy.copy(self)
        new.load_fitted(arrays)
        return new

    def blank_fitted(self, heads: int) -> Dict[str, mx.array]:
        return {name: mx.zeros(shape, dtype) for name, (shape, dtype) in self.fitted_spec(heads).items()}


class PerTokenLayout(FittedParams):
    """Mixin for layouts whose arrays all hold the token axis at 2 (``(B, H, n, ...)``), one token per block.

    A layout declares ``token_fields() -> {field: (shape after (B, H, n), dtype)}``; `code_layout` and
    `check_codes` follow from it.
    """

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

    def token_fields(self) -> Dict[str, Tuple[Tuple[int, ...], mx.Dtype]]:
        raise NotImplementedError(f"{type(self).__name__} must declare token_fields()")

    def code_layout(self, heads: int) -> Dict[str, CodeField]:
        return {f: CodeField(TOKEN_AXIS, 1, (1, heads, 1) + tuple(trailing), dtype)
                for f, (trailing, dtype) in self.token_fields().items()}

    def check_codes(self, codes: Dict[str, mx.array], name: str) -> None:
        """The fields `encode` writes, sharing (B, H, n) (what a restore must find)."""
        expected = self.token_fields()
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
