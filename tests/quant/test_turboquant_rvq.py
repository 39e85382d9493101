"""TurboQuant-RVQ (`veloxquant_mlx.quant.turboquant_rvq`): two stages beat one, and a decode that is the two
codebooks' levels summed, rotated back and scaled by the norm."""
import mlx.core as mx
import numpy as np

from veloxquant_mlx.quant.codebooks import mean_abs_residual
from veloxquant_mlx.quant.turboquant_mse import TurboQuantMSE
from veloxquant_mlx.quant.turboquant_rvq import TurboQuantRVQ
from _quantizer_helpers import _d_mse, unit_vectors  # noqa: F401 - a fixture


def test_rvq_beats_mse(unit_vectors):
    d = 128
    x = unit_vectors[d][:5000]
    for b in (1, 2, 3, 4):
        rvq = TurboQuantRVQ(d, b)
        ev = rvq.encode(x)
        assert ev.indices2 is not None and ev.indices.shape == ev.indices2.shape
        mse = TurboQuantMSE(d, b)
        assert _d_mse(x, rvq.decode(ev)) < _d_mse(x, mse.decode(mse.encode(x)))
    assert TurboQuantRVQ(d, 2).laplace_scale > 0


def test_decode_is_the_two_codebooks_summed_rotated_back_and_scaled():
    rvq = TurboQuantRVQ(32, 2, seed=4, norm_dtype="float32")
    assert rvq.laplace_scale == mean_abs_residual(rvq.codebook1) and rvq.codebook2.dist == "laplace"
    x = mx.array(np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32) * 3)
    ev = rvq.encode(x)
    c = mx.take(rvq.codebook1.centroids, ev.codes(2).astype(mx.int32)) + \
        mx.take(rvq.codebook2.centroids, ev.codes(2, "indices2").astype(mx.int32))
    want = rvq.rotation.invert(c * ev.norms[:, None])
    np.testing.assert_allclose(np.array(rvq.decode(ev)), np.array(want), rtol=1e-5, atol=1e-5)
    assert ev.nbytes == 5 * (2 * 2 * 4 + 4)  # two 2-bit streams of 32 codes (2 words each) and a float32 norm
    assert repr(rvq) == "TurboQuantRVQ(d=32, b=2, seed=4, rotation='haar')"
