"""Shared validation and helpers of the TurboQuant quantizers (no quantization logic here)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from veloxquant_mlx.quant.encoded_vector import EncodedVector

NORM_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
_FLOAT_DTYPES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32", mx.float64: "float64"}


class StoredNorms:
    """``norm_dtype`` read from ``norm_dtype_name``: a quantizer then holds no ``mx.Dtype`` (which cannot be
    pickled or deep-copied), so the standalone caches that hold one can be."""

    @property
    def norm_dtype(self):
        return NORM_DTYPES[self.norm_dtype_name]


def as_float_input(x, d: int, name: str = "x"):
    """Validate a ``(..., d)`` float input; returns (float32 mx.array, dtype name to decode to).

    numpy float64 is taken as float32 (MLX GPUs have no float64), and decodes to float32.
    """
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"{name} must have a float dtype, got numpy {x.dtype}")
        x = mx.array(x.astype(np.float32) if x.dtype == np.float64 else x)
    elif not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array or numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must have a float dtype (float16, bfloat16, float32), got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] != d:
        raise ValueError(f"{name} must have shape (..., d) with d={d}, got {tuple(x.shape)}")
    name_out = _FLOAT_DTYPES[x.dtype]
    if name_out == "float64":
        name_out = "float32"
    return x.astype(mx.float32), name_out


def safe_norm(x: mx.array) -> mx.array:
    """``(..., d) float32 -> (...)`` L2 norm in float32, scaled by max|x| so it cannot overflow."""
    amax = mx.max(mx.abs(x), axis=-1, keepdims=True)
    scale = mx.where(amax > 0, amax, 1.0)
    return mx.sqrt(mx.sum(mx.square(x / scale), axis=-1)) * scale[..., 0]


def unit_and_norm(x: mx.array):
    """``(..., d)`` float32 -> (unit directions (..., d), norms (...)); zero rows give zero directions."""
    norms = safe_norm(x)
    safe = mx.where(norms > 0, norms, 1.0)  # guard the division: 0 / 1 = 0, no NaN
    return x / safe[..., None], norms


def check_encoded(ev, quantizer_type: str, d: int):
    """The codes ``ev`` a quantizer decodes or scores: an EncodedVector of this quantizer and ``d``, with float norms.

    Shapes only (no host sync): the code streams' widths are checked where they are read (`EncodedVector.codes`,
    ``sign_values``), naming the stream and the words it needs; the batch shapes when ``ev`` was built.
    """
    if not isinstance(ev, EncodedVector):
        raise TypeError(f"ev must be an EncodedVector (what encode returns), got {type(ev).__name__}")
    # Its fields may have been assigned or replaced since it was built: checked again, named ev.<field>.
    ev.check("ev")
    if ev.quantizer_type != quantizer_type:
        raise ValueError(f"ev was encoded by {ev.quantizer_type!r}, this quantizer is {quantizer_type!r}")
    if ev.dim != d:
        raise ValueError(f"ev has dim {ev.dim}, this quantizer has d={d}")
    for name in ("norms", "residual_norm"):
        a = getattr(ev, name)
        if a is not None and a.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"ev.{name} must be a float array (bfloat16, float16 or float32) of shape "
                             f"{ev.batch_shape}, got {a.dtype}")


def as_query(q, d: int, batch_shape: tuple):
    """Validate a query ``(d,)`` or ``(..., m, d)`` against codes of batch shape ``batch_shape`` -> float32 mx.array.

    The scores are ``(..., m, n)`` for codes ``(..., n)``: q's leading axes (all but its last two) must broadcast
    with the codes' (all but n). Checked here, so a mismatch names ``q`` instead of failing inside MLX.
    """
    qf, _ = as_float_input(q, d, "q")
    q_lead, k_lead = tuple(qf.shape[:-2]), tuple(batch_shape[:-1])
    if not _broadcastable(q_lead, k_lead):
        raise ValueError(f"q has shape {tuple(qf.shape)}: its leading axes {q_lead} do not broadcast with the codes' "
                         f"{k_lead} (ev batch shape {tuple(batch_shape)}); expected q of shape (d,) = ({d},) or "
                         f"(..., m, {d}) with ... broadcastable to {k_lead}")
    return qf


def _broadcastable(a: tuple, b: tuple) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b)))


def scores(q_rot: mx.array, k_rot: mx.array) -> mx.array:
    """q ``(d,)`` with keys ``(..., n, d)`` -> ``(..., n)``; q ``(..., m, d)`` -> ``(..., m, n)``.

    A single key ``(d,)`` (codes of batch shape ``()``) gives ``()`` and ``(..., m)``."""
    if q_rot.ndim == 1 or k_rot.ndim == 1:
        return k_rot @ q_rot if q_rot.ndim == 1 else q_rot @ k_rot
    return q_rot @ mx.swapaxes(k_rot, -1, -2)


def dtype_from_name(name: str):
    return getattr(mx, name)


def store_norms(norms: mx.array, dtype, name: str = "norm_dtype") -> mx.array:
    """``(...)`` float32 norms -> ``dtype`` for storage; ValueError naming ``name`` if any would not survive.

    Only float16 can fail (bfloat16 and float32 cover float32's range): a norm above 65504 would be
    stored as inf, a non-zero norm below its smallest normal (6.1e-5) loses its precision or becomes 0.
    The check costs one host sync, paid only by ``norm_dtype="float16"``.
    """
    if dtype == mx.float16 and norms.size:
        fi = mx.finfo(mx.float16)
        big = float(mx.max(norms))
        small = float(mx.min(mx.where(norms > 0, norms, mx.inf)))
        if not big <= fi.max or small < fi.smallest_normal:
            raise ValueError(
                f"{name}='float16' cannot store these vector norms (range [{small:.3g}, {big:.3g}]; float16 "
                f"holds [{fi.smallest_normal:.3g}, {fi.max:.0f}]): use norm_dtype='bfloat16' (default) or 'float32'")
    return norms.astype(dtype)


def to_output_dtype(x: mx.array, name: str) -> mx.array:
    """float32 reconstruction -> dtype ``name``, clipped to that dtype's finite range first.

    A reconstruction of an input near float16's +-65504 can overshoot it by the quantization error;
    clipping keeps it finite (the nearest representable value) instead of +-inf. NaN stays NaN.
    """
    dtype = dtype_from_name(name)
    if dtype in (mx.float16, mx.bfloat16):
        hi = mx.finfo(dtype).max
        x = mx.clip(x, -hi, hi)
    return x.astype(dtype)
