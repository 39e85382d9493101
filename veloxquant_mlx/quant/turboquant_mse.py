"""TurboQuant-MSE: random rotation + per-coordinate Lloyd-Max codebook (arXiv 2504.19874, Alg. 1).

x (..., d) -> norm ||x|| (stored apart, float32-computed, bf16 by default) and the unit direction
u = x/||x||; y = Pi u has coordinates distributed like one coordinate of a random unit vector, so each
is quantized with the Beta (or Gaussian-limit) Lloyd-Max codebook; indices are bit-packed.
Reconstruction: ||x|| * Pi^T c[idx].
"""
from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.quant.codebooks import Codebook, lloyd_max_codebook, quantize_to_codebook
from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.bit_pack import pack
from veloxquant_mlx.quant.rotation import ROTATION_KINDS, make_rotation
from veloxquant_mlx.validate import check_choice, check_int
from veloxquant_mlx.quant.quantizer_common import (NORM_DTYPES, StoredNorms, as_float_input, as_query, check_encoded, scores, store_norms,
                      to_output_dtype, unit_and_norm)

CODEBOOK_KINDS = ("beta", "gaussian")


class TurboQuantMSE(StoredNorms):
    """MSE-optimal TurboQuant at ``b`` bits per coordinate.

    Args:
        d: vector length (int >= 2; the Beta density needs d >= 2).
        b: bits per coordinate, 1..8.
        seed: rotation seed (int >= 0).
        rotation: "haar" or "hadamard".
        codebook: "beta" (exact law of a rotated coordinate) or "gaussian" (N(0, 1/d) limit).
        norm_dtype: storage dtype of the norms: "bfloat16" (default), "float16" or "float32". With
            "float16", encoding a vector whose norm float16 cannot hold (> 65504, or non-zero < 6.1e-5)
            raises ValueError rather than storing inf or 0.

    ``decode`` returns the input's dtype, clipped to its finite range (float16 inputs near +-65504 do not
    decode to inf).
    """

    quantizer_type = "turboquant_mse"

    def __init__(self, d: int, b: int, seed: int = 0, rotation: str = "haar", codebook: str = "beta",
                 norm_dtype: str = "bfloat16"):
        self.d = check_int("d", d, 2)
        self.b = check_int("b", b, 1, 8)
        self.seed = check_int("seed", seed, 0)
        self.rotation_kind = check_choice("rotation", rotation, ROTATION_KINDS)
        self.codebook_kind = check_choice("codebook", codebook, CODEBOOK_KINDS)
        self.norm_dtype_name = check_choice("norm_dtype", norm_dtype, NORM_DTYPES)
        self.rotation = make_rotation(self.d, self.seed, self.rotation_kind)
        self.codebook: Codebook = lloyd_max_codebook(self.codebook_kind, self.b, d=self.d)

    # --- rotated-domain core, shared with TurboQuantProd -------------------------------------
    def _encode_rotated(self, x: mx.array):
        """float32 (..., d) -> (codes (..., d), float32 norms, stored norms, rotated unit y)."""
        u, norms = unit_and_norm(x)
        y = self.rotation.apply(u)
        idx = quantize_to_codebook(y, self.codebook)
        return idx, norms, store_norms(norms, self.norm_dtype), y

    def _reconstruct_rotated(self, idx: mx.array, norms: mx.array) -> mx.array:
        """codes (..., d), norms (...) -> (..., d) float32 reconstruction in the rotated basis."""
        return mx.take(self.codebook.centroids, idx.astype(mx.int32)) * norms.astype(mx.float32)[..., None]

    # --- public API ---------------------------------------------------------------------------
    def encode(self, x) -> EncodedVector:
        """``(..., d)`` float array -> EncodedVector with batch shape ``(...)``."""
        xf, dtype_name = as_float_input(x, self.d)
        idx, _, stored, _ = self._encode_rotated(xf)
        return EncodedVector(quantizer_type=self.quantizer_type, dim=self.d, indices=pack(idx, self.b, check=False),
                             norms=stored, dtype_name=dtype_name, bits=self.b)

    def decode_rotated(self, ev: EncodedVector) -> mx.array:
        """``(..., d)`` float32 reconstruction expressed in the rotated basis (norm applied)."""
        check_encoded(ev, self.quantizer_type, self.d)
        return self._reconstruct_rotated(ev.codes(self.b), ev.norm_values())

    def decode(self, ev: EncodedVector) -> mx.array:
        """``(..., d)`` reconstruction in the input's dtype."""
        return to_output_dtype(self.rotation.invert(self.decode_rotated(ev)), ev.dtype_name)

    def estimate_inner_product(self, q, ev: EncodedVector) -> mx.array:
        """q ``(..., m, d)`` with ev batch ``(..., n)`` -> ``(..., m, n)``; q ``(d,)`` -> ``(..., n)``.

        Equals q · decode(ev): the query is rotated once and dotted with the rotated reconstruction
        (<q, Pi^T k> = <Pi q, k>), so keys are never rotated back.
        """
        check_encoded(ev, self.quantizer_type, self.d)  # before q is checked against its batch shape
        q_rot = self.rotation.apply(as_query(q, self.d, ev.batch_shape))
        return scores(q_rot, self.decode_rotated(ev))

    @property
    def expected_d_mse(self) -> float:
        """Codebook-predicted E||u - u_hat||^2 for unit vectors (d * per-coordinate MSE)."""
        return self.d * self.codebook.mse

    def __repr__(self):
        return (f"TurboQuantMSE(d={self.d}, b={self.b}, seed={self.seed}, rotation={self.rotation_kind!r}, "
                f"codebook={self.codebook_kind!r}, norm_dtype={self.norm_dtype_name!r})")
