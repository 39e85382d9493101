"""TurboQuant-Prod: TurboQuant-MSE at b-1 bits + a 1-bit QJL sketch of the residual (arXiv 2504.19874, Alg. 2).

In the rotated basis (y = Pi x, orthogonal so inner products are unchanged) with MSE reconstruction
y_mse = ||x|| c[idx] (using the *stored* norm, so its rounding is corrected too):
    r = ||x|| Pi u - y_mse,   signs = sign(S r)   (S: m x d i.i.d. N(0, 1), seeded),   gamma = ||r||.
Since E[<S q, sign(S r)>] = m sqrt(2/pi) <q, r> / ||r||, the estimate
    <q, x> ~= <Pi q, y_mse> + gamma sqrt(pi/2) / m <S Pi q, signs>
is unbiased, with variance ~ pi/(2m) ||r||^2 ||q||^2. b = 1 means 0 MSE bits: a pure QJL sketch
of x itself (y_mse = 0, r = x).
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.bit_pack import pack
from veloxquant_mlx.quant.rotation import ROTATION_KINDS, STREAM_QJL, make_rotation
from veloxquant_mlx.validate import check_choice, check_int
from veloxquant_mlx.quant.quantizer_common import (NORM_DTYPES, StoredNorms, as_float_input, as_query, check_encoded, safe_norm, scores,
                      store_norms, to_output_dtype, unit_and_norm)
from veloxquant_mlx.quant.turboquant_mse import CODEBOOK_KINDS, TurboQuantMSE



def orthogonal_sketch(d: int, m: int, seed: int) -> np.ndarray:
    """``(m, d)`` float32 QJL sketch: seeded Haar-orthogonal ``d x d`` blocks stacked to ``m`` rows, times sqrt(d).

    Each row is uniform on the sphere of radius sqrt(d) (so the estimate stays unbiased), and rows of one block
    are orthogonal: their sign bits do not repeat each other, which cuts the estimate's variance to about
    (1 - 2/pi) of i.i.d. Gaussian rows' at m = d (orthogonal random features).
    """
    rng = np.random.default_rng([seed, STREAM_QJL])
    blocks = []
    for _ in range(-(-m // d)):
        q, r = np.linalg.qr(rng.standard_normal((d, d)))
        blocks.append(q * np.sign(np.diag(r)))
    return (np.concatenate(blocks)[:m] * math.sqrt(d)).astype(np.float32)


def sign_gain(d: int) -> float:
    """E[(s.q) sign(s.r)] / <q, r/|r|> for s uniform on the radius-sqrt(d) sphere: sqrt(d) E|u_1| (-> sqrt(2/pi))."""
    return math.sqrt(d) * math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)


class TurboQuantProd(StoredNorms):
    """Inner-product-unbiased TurboQuant at ``b`` bits per coordinate (b-1 MSE bits + 1 QJL bit).

    Args:
        d: vector length (int >= 2). b: total bits 1..8 (b = 1: pure QJL).
        m: QJL sketch length (int >= 1), default ``m_default(d, b)`` = d.
        seed, rotation, codebook, norm_dtype: as in :class:`TurboQuantMSE` (norm_dtype also stores the
            residual norms; "float16" refuses norms it cannot hold).
    """

    quantizer_type = "turboquant_prod"

    def __init__(self, d: int, b: int, m: int | None = None, seed: int = 0, rotation: str = "haar",
                 codebook: str = "beta", norm_dtype: str = "bfloat16"):
        self.d = check_int("d", d, 2)
        self.b = check_int("b", b, 1, 8)
        self.m = self.m_default(self.d, self.b) if m is None else check_int("m", m, 1)
        self.seed = check_int("seed", seed, 0)
        self.rotation_kind = check_choice("rotation", rotation, ROTATION_KINDS)
        self.codebook_kind = check_choice("codebook", codebook, CODEBOOK_KINDS)
        self.norm_dtype_name = check_choice("norm_dtype", norm_dtype, NORM_DTYPES)
        self.mse = (TurboQuantMSE(self.d, self.b - 1, self.seed, rotation, codebook, norm_dtype)
                    if self.b > 1 else None)
        self.rotation = self.mse.rotation if self.mse is not None else make_rotation(self.d, self.seed, rotation)
        # S acts on rotated-basis vectors; in the original basis the sketch matrix is S @ Pi.
        self.qjl_matrix = mx.array(orthogonal_sketch(self.d, self.m, self.seed))  # (m, d)
        self._qjl_t = mx.contiguous(self.qjl_matrix.T)  # (d, m)
        self._qjl_scale = 1.0 / (self.m * sign_gain(self.d))

    @staticmethod
    def m_default(d: int, b: int) -> int:
        """Default QJL sketch length: m = d (the paper's choice)."""
        return check_int("d", d, 1)

    def encode(self, x) -> EncodedVector:
        """``(..., d)`` float array -> EncodedVector (indices, norms, signs, residual_norm)."""
        xf, dtype_name = as_float_input(x, self.d)
        if self.mse is not None:
            idx, norms, stored, y = self.mse._encode_rotated(xf)
            y_mse = self.mse._reconstruct_rotated(idx, stored)
            r = y * norms[..., None] - y_mse  # residual vs what decode will actually produce
            packed = pack(idx, self.b - 1, check=False)
        else:
            u, norms = unit_and_norm(xf)
            stored = store_norms(norms, self.norm_dtype)
            packed = mx.zeros((*xf.shape[:-1], 0), dtype=mx.uint32)
            r = self.rotation.apply(xf)
        proj = r @ self._qjl_t  # (..., m)
        signs = pack((proj >= 0).astype(mx.uint8), 1, check=False)
        return EncodedVector(quantizer_type=self.quantizer_type, dim=self.d, indices=packed, norms=stored,
                             signs=signs, residual_norm=store_norms(safe_norm(r), self.norm_dtype),
                             dtype_name=dtype_name, bits=self.b - 1, n_signs=self.m)

    def _signs_pm(self, ev: EncodedVector) -> mx.array:
        """(..., m) float32 ±1 (packed sign bits, or the seed's ±1 values)."""
        return ev.sign_values(self.m)

    @staticmethod
    def _residual_norm(ev: EncodedVector) -> mx.array:
        if ev.residual_norm is None:
            raise ValueError("ev.residual_norm is missing: TurboQuantProd codes need the residual norms")
        return ev.residual_norm.astype(mx.float32)

    def decode_rotated_mse(self, ev: EncodedVector) -> mx.array:
        """``(..., d)`` float32 MSE-stage reconstruction in the rotated basis (zeros when b = 1)."""
        check_encoded(ev, self.quantizer_type, self.d)
        if self.mse is None:
            return mx.zeros((*ev.batch_shape, self.d), dtype=mx.float32)
        return self.mse._reconstruct_rotated(ev.codes(self.b - 1), ev.norm_values())

    def decode_rotated(self, ev: EncodedVector) -> mx.array:
        """``(..., d)`` float32 unbiased reconstruction in the rotated basis:
        y_mse + gamma sqrt(pi/2)/m S^T signs."""
        check_encoded(ev, self.quantizer_type, self.d)
        qjl = (self._signs_pm(ev) @ self.qjl_matrix) * (
            self._residual_norm(ev)[..., None] * self._qjl_scale)
        return self.decode_rotated_mse(ev) + qjl

    def decode(self, ev: EncodedVector) -> mx.array:
        """``(..., d)`` unbiased reconstruction in the input dtype (its MSE is larger than MSE-only)."""
        return to_output_dtype(self.rotation.invert(self.decode_rotated(ev)), ev.dtype_name)

    def estimate_inner_product(self, q, ev: EncodedVector) -> mx.array:
        """Unbiased <q, x>: q ``(..., m_q, d)`` with ev batch ``(..., n)`` -> ``(..., m_q, n)``;
        q ``(d,)`` -> ``(..., n)``. The query is rotated and sketched once; keys stay packed-size."""
        check_encoded(ev, self.quantizer_type, self.d)
        q_rot = self.rotation.apply(as_query(q, self.d, ev.batch_shape))
        out = scores(q_rot, self.decode_rotated_mse(ev)) if self.mse is not None else None
        sq = q_rot @ self._qjl_t  # (..., m_q, m) or (m,)
        qjl = scores(sq, self._signs_pm(ev))
        gamma = self._residual_norm(ev) * self._qjl_scale  # (..., n)
        qjl = qjl * (gamma if q_rot.ndim == 1 or gamma.ndim == 0 else gamma[..., None, :])  # ev of one key: ()
        return qjl if out is None else out + qjl

    def __repr__(self):
        return (f"TurboQuantProd(d={self.d}, b={self.b}, m={self.m}, seed={self.seed}, "
                f"rotation={self.rotation_kind!r}, codebook={self.codebook_kind!r})")
