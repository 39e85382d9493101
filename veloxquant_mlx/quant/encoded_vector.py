"""`EncodedVector`: what a TurboQuant quantizer stores for a batch of vectors.

Every array's leading axes are the batch shape of the encoded input: an input ``(..., d)`` gives
``norms`` ``(...)`` and code streams ``(..., n_words)``. Storage is packed: uint32 words, LSB-first (see
:mod:`veloxquant_mlx.quant.bit_pack`). Nothing here is a full-precision copy of the input.

The seed's view is offered too: ``ev.indices`` reads as ``(..., d)`` code indices and ``ev.signs`` as
``(..., m)`` ±1 values (unpacked on read), and an EncodedVector can be built from those unpacked forms
with the seed's fields (``quantizer_type, batch_size, dim, indices, signs, residual_norm``). Which form a
stream was given in is told by its shape: packed words are uint32 with fewer than ``d`` entries (b <= 8
bits fill ceil(d*b/32) < d words for d >= 2); code indices have exactly ``d``.

As the seed's was, an EncodedVector is a dataclass: ``dataclasses.replace(ev, norms=...)`` builds a new one through
the checking constructor (the array fields read in the seed's unpacked view), and the array fields can be assigned.
The quantizers check the whole EncodedVector again before they decode it (`EncodedVector.check`), so a damaged
one is refused naming the field, never read until MLX fails on it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import mlx.core as mx
import numpy as np

from veloxquant_mlx.quant.bit_pack import packed_words, unpack

_ARRAY_FIELDS = ("indices", "norms", "signs", "residual_norm", "indices2")
# The dtypes code indices may have (what the quantizers and the seed write: uint8 codes, uint32 packed words).
CODE_DTYPES = (mx.uint8, mx.uint16, mx.uint32)


def _as_array(value, name: str, owner: str = "EncodedVector"):
    if value is None or isinstance(value, mx.array):
        return value
    if isinstance(value, np.ndarray):
        return mx.array(value)
    raise TypeError(f"{owner}.{name} must be an mx.array, a numpy array or None, got {type(value).__name__}")


def _is_int(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _check_bits(value, name: str, lo: int, owner: str = "EncodedVector"):
    if value is None:
        return None
    if not _is_int(value) or not lo <= int(value) <= 8:
        raise ValueError(f"{owner}.{name} must be an int in {lo}..8 or None, got {value!r}")
    return int(value)


# A dataclass as the seed's was (``dataclasses.replace`` and ``fields`` work), with the checking constructor below:
# init=False keeps it, eq/repr stay ours. The array fields are properties (packed storage, the seed's view on read).
@dataclasses.dataclass(init=False, repr=False, eq=False)
class EncodedVector:
    """Packed TurboQuant codes for a batch of ``dim``-dimensional vectors.

    Args:
        quantizer_type: ``"turboquant_mse"``, ``"turboquant_prod"`` or ``"turboquant_rvq"``.
        dim: ``d``, the length of each encoded vector.
        indices: codebook indices (stage 1 for RVQ): ``(..., words)`` uint32 packed, or ``(..., d)`` codes.
        norms: ``(...)`` vector norms; None (the seed's field set has none) reads as unit norms.
        signs: QJL signs of the residual (Prod only): ``(..., words)`` uint32 packed bits, or ±1 values.
        residual_norm: ``(...)`` norm of the MSE residual (Prod only).
        indices2: stage-2 residual indices (RVQ only), as ``indices``.
        dtype_name: the input's dtype name; ``decode`` returns this dtype.
        batch_size: optional, checked against the arrays (the seed passes it).
        bits: bits per index (0 = no index stream, Prod at b = 1); needed only to read packed ``indices``
            in the seed's unpacked view. n_signs: the sketch length m, likewise for packed ``signs``.
    """

    quantizer_type: str
    dim: int
    indices: Optional[mx.array]
    norms: Optional[mx.array]
    signs: Optional[mx.array]
    residual_norm: Optional[mx.array]
    indices2: Optional[mx.array]
    dtype_name: str
    bits: Optional[int]
    n_signs: Optional[int]

    def __init__(self, quantizer_type: str, dim: int, indices=None, norms=None, signs=None,
                 residual_norm=None, indices2=None, dtype_name: str = "float32", *,
                 batch_size: Optional[int] = None, bits: Optional[int] = None, n_signs: Optional[int] = None):
        self.quantizer_type = quantizer_type
        self.dim = dim
        self.dtype_name = dtype_name
        self.bits = bits
        self.n_signs = n_signs
        given = dict(indices=indices, norms=norms, signs=signs, residual_norm=residual_norm, indices2=indices2)
        self._stored = {k: _as_array(v, k) for k, v in given.items() if v is not None}
        self.check()
        self.dim, self.bits = int(self.dim), _check_bits(self.bits, "bits", 0)
        self.n_signs = None if self.n_signs is None else int(self.n_signs)
        if batch_size is not None and batch_size != self.batch_size:
            raise ValueError(f"EncodedVector.batch_size={batch_size!r} does not match the arrays' batch "
                             f"shape {self.batch_shape} ({self.batch_size} vectors)")

    def check(self, owner: str = "EncodedVector") -> None:
        """Refuse fields that do not make an EncodedVector, naming ``owner.field`` (shapes and types only, no
        host sync). Run by the constructor and again by every decode (``owner="ev"``): assigned fields and
        ``dataclasses.replace`` copies are checked before anything reads them."""
        if not isinstance(self.quantizer_type, str):
            raise TypeError(f"{owner}.quantizer_type must be a str, got {type(self.quantizer_type).__name__}")
        if not _is_int(self.dim) or self.dim < 1:
            raise ValueError(f"{owner}.dim must be an int >= 1, got {self.dim!r}")
        dtype = getattr(mx, self.dtype_name, None) if isinstance(self.dtype_name, str) else None
        if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):  # what decode casts to
            raise ValueError(f"{owner}.dtype_name must name an MLX float dtype ('float32', 'float16' or "
                             f"'bfloat16'), got {self.dtype_name!r}")
        _check_bits(self.bits, "bits", 0, owner)
        if self.n_signs is not None and (not _is_int(self.n_signs) or self.n_signs < 1):
            raise ValueError(f"{owner}.n_signs must be an int >= 1 or None, got {self.n_signs!r}")
        stored = getattr(self, "_stored", None)
        if not isinstance(stored, dict):
            raise TypeError(f"{owner} holds no arrays: build it with EncodedVector(...) or a quantizer's encode")
        for name, a in stored.items():
            if not isinstance(a, mx.array):
                raise TypeError(f"{owner}.{name} must be an mx.array, got {type(a).__name__}")
        if "indices" not in stored:
            raise ValueError(f"{owner}.indices is required (packed uint32 words or (..., d) code indices)")
        for name in ("indices", "indices2"):
            a = stored.get(name)
            if a is not None and (a.ndim == 0 or not mx.issubdtype(a.dtype, mx.integer)):
                raise ValueError(f"{owner}.{name} must be an integer array (..., words) or (..., d), "
                                 f"got dtype {a.dtype}, shape {tuple(a.shape)}")
            # codes are unsigned: a signed array's negative entries would index the codebook from its end
            if a is not None and a.dtype not in CODE_DTYPES:
                raise TypeError(f"{owner}.{name} must hold unsigned codes: uint32 packed words (..., words) or "
                                f"uint8 / uint16 / uint32 code indices (..., d); got dtype {a.dtype}")
        s = stored.get("signs")
        if s is not None and s.ndim == 0:
            raise ValueError(f"{owner}.signs must have a trailing sign axis, got a scalar")
        lead, ref = self.batch_shape, self._batch_field()
        for name, a in stored.items():
            got = tuple(a.shape) if name in ("norms", "residual_norm") else tuple(a.shape[:-1])
            if got != lead:
                raise ValueError(f"{owner}.{name} has batch shape {got} but {owner}.{ref} has {lead} "
                                 "(every field shares the leading axes)")

    def _assign(self, name: str, value) -> None:
        # The seed's dataclass took assignments; the arrays are checked as a whole when decoded (`check`).
        a = _as_array(value, name)
        if a is None:
            self._stored.pop(name, None)
        else:
            self._stored[name] = a

    # -- stored (packed) form ------------------------------------------------------------------------
    def arrays(self) -> dict:
        """The stored arrays by constructor name (the ones that are not None): feed back as ``**kwargs``."""
        return dict(self._stored)

    def _is_packed(self, name: str) -> bool:
        a = self._stored[name]
        if name == "signs":
            return a.dtype == mx.uint32
        return a.dtype == mx.uint32 and a.shape[-1] != self.dim

    def codes(self, bits: int, name: str = "indices") -> mx.array:
        """Stream ``name`` as ``(..., d)`` code indices at ``bits`` bits (what the quantizer decodes)."""
        a = self._stored.get(name)
        if a is None:
            raise ValueError(f"EncodedVector.{name} is missing (quantizer_type={self.quantizer_type!r})")
        if not self._is_packed(name):
            if a.shape[-1] != self.dim:
                raise ValueError(f"EncodedVector.{name} must have d={self.dim} code indices, got shape {tuple(a.shape)}")
            return a
        if bits == 0:
            return mx.zeros((*a.shape[:-1], self.dim), dtype=mx.uint8)
        words = packed_words(self.dim, bits)
        if a.shape[-1] != words:
            raise ValueError(f"EncodedVector.{name} holds {a.shape[-1]} words per vector; d={self.dim} at "
                             f"bits={bits} needs {words}")
        return unpack(a, bits, self.dim)

    def sign_values(self, m: int) -> mx.array:
        """The ``(..., m)`` signs as float32 ±1 (unpacking packed bits)."""
        s = self._stored.get("signs")
        if s is None:
            raise ValueError(f"EncodedVector.signs is missing (quantizer_type={self.quantizer_type!r})")
        if self._is_packed("signs"):
            if s.shape[-1] != packed_words(m, 1):
                raise ValueError(f"EncodedVector.signs holds {s.shape[-1]} words per vector; m={m} signs need "
                                 f"{packed_words(m, 1)}")
            return unpack(s, 1, m).astype(mx.float32) * 2.0 - 1.0
        if s.shape[-1] != m:
            raise ValueError(f"EncodedVector.signs must have m={m} values per vector, got shape {tuple(s.shape)}")
        return mx.where(s > 0, 1.0, -1.0).astype(mx.float32)

    def norm_values(self) -> mx.array:
        """``(...)`` float32 norms; ones when none were stored (the seed's unit vectors)."""
        n = self._stored.get("norms")
        return mx.ones(self.batch_shape, dtype=mx.float32) if n is None else n.astype(mx.float32)

    # -- the seed's view -----------------------------------------------------------------------------
    def _seed_codes(self, name: str):
        if name not in self._stored:
            return None
        if not self._is_packed(name):
            return self._stored[name]
        if self.bits is None:
            raise ValueError(f"EncodedVector.{name} is stored packed and this EncodedVector was built without "
                             "bits=...; use codes(bits) or arrays()")
        return self.codes(self.bits, name)

    @property
    def indices(self):
        """``(..., d)`` code indices (uint8), unpacked from storage on read."""
        return self._seed_codes("indices")

    @indices.setter
    def indices(self, value):
        self._assign("indices", value)

    @property
    def indices2(self):
        """``(..., d)`` stage-2 code indices (RVQ), or None."""
        return self._seed_codes("indices2")

    @indices2.setter
    def indices2(self, value):
        self._assign("indices2", value)

    @property
    def signs(self):
        """``(..., m)`` int8 ±1 QJL signs, or None."""
        s = self._stored.get("signs")
        if s is None:
            return None
        if not self._is_packed("signs"):
            return mx.where(s > 0, 1, -1).astype(mx.int8)
        if self.n_signs is None:
            raise ValueError("EncodedVector.signs is stored packed and this EncodedVector was built without "
                             "n_signs=...; use sign_values(m) or arrays()")
        return self.sign_values(self.n_signs).astype(mx.int8)

    @signs.setter
    def signs(self, value):
        self._assign("signs", value)

    @property
    def norms(self):
        return self._stored.get("norms")

    @norms.setter
    def norms(self, value):
        self._assign("norms", value)

    @property
    def residual_norm(self):
        return self._stored.get("residual_norm")

    @residual_norm.setter
    def residual_norm(self, value):
        self._assign("residual_norm", value)

    # -- sizes ---------------------------------------------------------------------------------------
    def _batch_field(self) -> str:
        return next((n for n in ("norms", "residual_norm") if n in self._stored), "indices")

    @property
    def batch_shape(self) -> tuple:
        name = self._batch_field()
        a = self._stored[name]
        return tuple(a.shape) if name != "indices" else tuple(a.shape[:-1])

    @property
    def batch_size(self) -> int:
        """Number of encoded vectors (product of the batch shape)."""
        return math.prod(self.batch_shape)

    @property
    def nbytes(self) -> int:
        """True byte size of everything stored (not a bit-width estimate)."""
        return sum(a.nbytes for a in self._stored.values())

    @property
    def bits_per_coordinate(self) -> float:
        """Stored bits per coordinate, all overheads (norms, padding) included."""
        return 8.0 * self.nbytes / max(1, self.batch_size * self.dim)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self._stored.items())
        return f"EncodedVector({self.quantizer_type!r}, dim={self.dim}, {shapes})"
