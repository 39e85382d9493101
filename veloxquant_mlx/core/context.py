"""`EncodedVector`: what a TurboQuant quantizer stores for a batch of vectors.

Every field is an MLX array whose leading axes are the batch shape of the encoded input,
i.e. an input of shape ``(..., d)`` gives ``norms`` of shape ``(...)`` and packed codes of
shape ``(..., n_words)`` (uint32, LSB-first, see :mod:`veloxquant_mlx.dsa.bit_pack`).
Nothing here is a full-precision copy of the input.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import mlx.core as mx


@dataclass
class EncodedVector:
    """Packed TurboQuant codes for a batch of ``d``-dimensional vectors.

    Attributes:
        quantizer_type: ``"turboquant_mse"``, ``"turboquant_prod"`` or ``"turboquant_rvq"``.
        dim: ``d``, the length of each encoded vector.
        indices: ``(..., words)`` uint32, packed codebook indices (stage 1 for RVQ).
        norms: ``(...)`` the vector norms (bfloat16 by default: cannot overflow past 65504).
        signs: ``(..., words)`` uint32, packed 1-bit QJL signs of the residual (Prod only).
        residual_norm: ``(...)`` norm of the MSE residual (Prod only).
        indices2: ``(..., words)`` uint32, packed stage-2 residual indices (RVQ only).
        dtype_name: the input's dtype name; ``decode`` returns this dtype.
    """

    quantizer_type: str
    dim: int
    indices: mx.array
    norms: mx.array
    signs: Optional[mx.array] = None
    residual_norm: Optional[mx.array] = None
    indices2: Optional[mx.array] = None
    dtype_name: str = "float32"

    def arrays(self) -> dict:
        """The stored arrays by field name (the ones that are not None)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if isinstance(getattr(self, f.name), mx.array)
        }

    @property
    def batch_shape(self) -> tuple:
        return tuple(self.norms.shape)

    @property
    def batch_size(self) -> int:
        """Number of encoded vectors (product of the batch shape)."""
        n = 1
        for s in self.batch_shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """True byte size of everything stored (not a bit-width estimate)."""
        return sum(a.nbytes for a in self.arrays().values())

    @property
    def bits_per_coordinate(self) -> float:
        """Stored bits per coordinate, all overheads (norms, padding) included."""
        return 8.0 * self.nbytes / max(1, self.batch_size * self.dim)
