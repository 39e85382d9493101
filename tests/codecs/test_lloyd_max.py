"""The ``lloyd_max`` layout (`veloxquant_mlx.codecs.lloyd_max`): the TurboQuant quantizers' codes read through the
fused level planes (every method and width against the quantizers' own decode), written by the compiled
compare-and-pack kernel (bit for bit the quantizers' arrays), and a decode token coded by the one compiled graph
exactly as a chunk is. The contract every layout meets is in `test_contract.py`.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from _codec_contract_helpers import H, data, rel, FUSED, LLOYD_CASES, _quantizer_decode


@pytest.mark.parametrize("method,bits,n_outliers", LLOYD_CASES)
def test_lloyd_max_fused_levels_equal_the_quantizers_decode(method, bits, n_outliers):
    from veloxquant_mlx.codecs import LloydMaxCodec

    c = LloydMaxCodec(method, 64, bits, n_outliers=n_outliers, outlier_bits=8)
    x = data(300)  # not a multiple of the kernels' token bucket (256)
    c.fit(x)
    codes = c.encode(x)
    fused = {g: c._fast(g, quant, codes) is not None for g, _, _, quant in c._groups()}
    if (method, bits) in FUSED:
        assert fused["i"], "a registered configuration's codes must be read by the fused kernels"
    if n_outliers:
        assert not fused["o"], "8-bit outlier codes have no exact level polynomial: gather path"
    ref = _quantizer_decode(c, codes)
    assert rel(c.decode(codes, mx.float32), ref) < 1e-6
    rng = np.random.default_rng(2)
    for rows in (1, 7):
        q = mx.array(rng.standard_normal((2, H, rows, 64)).astype(np.float32))
        p = mx.softmax(mx.array(rng.standard_normal((2, H, rows, 300)).astype(np.float32)), axis=-1)
        assert rel(c.scores(q, codes), q @ mx.swapaxes(ref, -1, -2)) < 1e-5
        assert rel(c.weighted_sum(p, codes), p @ ref) < 1e-5


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n_outliers", [0, 8])
def test_lloyd_max_fused_encode_writes_the_quantizers_codes(bits, n_outliers):
    """TurboQuant-MSE codes come from one compiled compare-and-pack kernel (codecs._levels.CodePacker): they must
    be the quantizer's own arrays bit for bit (a zero token and large values included)."""
    from veloxquant_mlx.codecs import LloydMaxCodec
    from veloxquant_mlx.codecs.lloyd_max import _packer, _permute

    c = LloydMaxCodec("turboquant_mse", 64, bits, n_outliers=n_outliers, outlier_bits=8)
    x = data(37) * 3.0
    x = mx.concatenate([x[:, :, :1] * 0.0, x[:, :, 1:]], axis=2)
    c.fit(x)
    codes = c.encode(x)
    assert (_packer(c.quantizers["i"]) is not None) == (bits <= 4)
    xf = x - c.mean.astype(mx.float32)[None, :, None, :]
    if c.perm is not None:
        xf = _permute(xf, c.perm)
    want = {}
    for g, start, width, quant in c._groups():
        want.update({f"{g}_{k}": v for k, v in quant.encode(xf[..., start: start + width]).arrays().items()})
    assert sorted(codes) == sorted(want)
    for f in want:
        assert codes[f].dtype == want[f].dtype and codes[f].shape == want[f].shape, f
        assert mx.array_equal(codes[f], want[f]).item(), f


@pytest.mark.parametrize("method,bits,n_outliers", [("turboquant_mse", 4, 0), ("turboquant_mse", 2, 8),
                                                     ("turboquant_prod", 4, 0), ("turboquant_prod", 3, 8),
                                                     ("turboquant_rvq", 2, 0), ("turboquant_mse", 8, 0)])
def test_lloyd_max_one_token_encode_is_the_chunk_encode_bit_for_bit(method, bits, n_outliers):
    """A decode token is coded by one compiled graph (`lloyd_max._token_encoder`), a chunk eagerly: the same
    arrays for the same token, a zero token and large values included, in a batch of rows."""
    from veloxquant_mlx.codecs import LloydMaxCodec

    c = LloydMaxCodec(method, 64, bits, n_outliers=n_outliers, outlier_bits=8)
    x = mx.concatenate([data(40) * 3.0, data(40) * -0.5], axis=0)  # (2, H, 40, 64)
    x = mx.concatenate([x[:, :, :1] * 0.0, x[:, :, 1:]], axis=2)
    c.fit(x[:1])
    whole = c.encode(x)
    for t in (0, 1, 39):
        one = c.encode(x[:, :, t:t + 1])
        assert sorted(one) == sorted(whole)
        for f in whole:
            assert one[f].dtype == whole[f].dtype, f
            assert mx.array_equal(one[f], whole[f][:, :, t:t + 1]).item(), (f, t)
