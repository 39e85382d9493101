"""TurboQuant-RVQ: two-stage residual vector quantization in the rotated basis.

Stage 1 quantizes the rotated unit direction y with the b-bit Gaussian N(0, 1/d) Lloyd-Max codebook;
stage 2 quantizes the residual r = y - c1[idx1] with a b-bit Laplace codebook. The Laplace scale is
fixed by theory, not data: E|r| under y ~ N(0, 1/d) for the stage-1 codebook (a Laplace(0, s) has
E|r| = s). Two b-bit index streams and one norm are stored; reconstruction ||x|| Pi^T (c1 + c2).
"""
from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.quant.codebooks import lloyd_max_codebook, mean_abs_residual, quantize_to_codebook
from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.bit_pack import pack
from veloxquant_mlx.quant.rotation import ROTATION_KINDS, make_rotation
from veloxquant_mlx.validate import check_choice, check_int
from veloxquant_mlx.quant.quantizer_common import (NORM_DTYPES, StoredNorms, as_float_input, as_query, check_encoded, scores, store_norms,
                      to_output_dtype, unit_and_norm)


class TurboQuantRVQ(StoredNorms):
    """Two-stage TurboQuant at ``b`` bits per stage (2b bits per coordinate in all).

    Args: d (int >= 2), b (1..8), seed (int >= 0), rotation ("haar"|"hadamard"),
    norm_dtype ("bfloat16"|"float16"|"float32"; "float16" refuses norms it cannot hold, see TurboQuantMSE).
    """

    quantizer_type = "turboquant_rvq"

    def __init__(self, d: int, b: int, seed: int = 0, rotation: str = "haar", norm_dtype: str = "bfloat16"):
        self.d = check_int("d", d, 2)
        self.b = check_int("b", b, 1, 8)
        self.seed = check_int("seed", seed, 0)
        self.rotation_kind = check_choice("rotation", rotation, ROTATION_KINDS)
        self.norm_dtype_name = check_choice("norm_dtype", norm_dtype, NORM_DTYPES)
        self.rotation = make_rotation(self.d, self.seed, self.rotation_kind)
        self.codebook1 = lloyd_max_codebook("gaussian", self.b, d=self.d)
        self.laplace_scale = mean_abs_residual(self.codebook1)
        self.codebook2 = lloyd_max_codebook("laplace", self.b, scale=self.laplace_scale)

    def encode(self, x) -> EncodedVector:
        """``(..., d)`` float array -> EncodedVector (indices, indices2, norms)."""
        xf, dtype_name = as_float_input(x, self.d)
        u, norms = unit_and_norm(xf)
        y = self.rotation.apply(u)
        idx1 = quantize_to_codebook(y, self.codebook1)
        r = y - mx.take(self.codebook1.centroids, idx1.astype(mx.int32))
        idx2 = quantize_to_codebook(r, self.codebook2)
        return EncodedVector(quantizer_type=self.quantizer_type, dim=self.d, indices=pack(idx1, self.b, check=False),
                             norms=store_norms(norms, self.norm_dtype), indices2=pack(idx2, self.b, check=False),
                             dtype_name=dtype_name, bits=self.b)

    def decode_rotated(self, ev: EncodedVector) -> mx.array:
        """``(..., d)`` float32 reconstruction in the rotated basis (norm applied)."""
        check_encoded(ev, self.quantizer_type, self.d)
        i1 = ev.codes(self.b).astype(mx.int32)
        i2 = ev.codes(self.b, "indices2").astype(mx.int32)
        y = mx.take(self.codebook1.centroids, i1) + mx.take(self.codebook2.centroids, i2)
        return y * ev.norm_values()[..., None]

    def decode(self, ev: EncodedVector) -> mx.array:
        """``(..., d)`` reconstruction in the input dtype."""
        return to_output_dtype(self.rotation.invert(self.decode_rotated(ev)), ev.dtype_name)

    def estimate_inner_product(self, q, ev: EncodedVector) -> mx.array:
        """q · decode(ev): q ``(..., m, d)`` -> ``(..., m, n)``; q ``(d,)`` -> ``(..., n)``."""
        check_encoded(ev, self.quantizer_type, self.d)  # before q is checked against its batch shape
        q_rot = self.rotation.apply(as_query(q, self.d, ev.batch_shape))
        return scores(q_rot, self.decode_rotated(ev))

    def __repr__(self):
        return f"TurboQuantRVQ(d={self.d}, b={self.b}, seed={self.seed}, rotation={self.rotation_kind!r})"
