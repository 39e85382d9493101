"""`veloxquant_mlx.codecs._dequant`: the fused dequantization against ``mx.dequantize``, bit for bit."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from _codec_contract_helpers import H


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_fused_dequantize_is_mx_dequantize_bit_for_bit(bits, group_size):
    """`codecs._dequant.dequantize` (a few fused ops instead of MLX's ~30-50 on CPU) against its reference,
    ``mx.dequantize``, on whole arrays, on slices along either axis (the views a cache attends) and with float16
    and float32 scales; the fused path must be the one taken for 2, 4 and 8 bits."""
    from veloxquant_mlx.codecs import _dequant

    x = mx.array(np.random.default_rng(bits).standard_normal((2, H, 40, 512)).astype(np.float32) * 4.0)
    w, s, b = mx.quantize(x, group_size=group_size, bits=bits)
    s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
    words = group_size * bits // 32
    views = [(w, s16, b16), (w, s, b), (w[1:, :, 3:29], s16[1:, :, 3:29], b16[1:, :, 3:29]),
             (w[..., words:3 * words], s16[..., 1:3], b16[..., 1:3])]
    for wv, sv, bv in views:
        want = mx.dequantize(wv, sv.astype(mx.float32), bv.astype(mx.float32), group_size=group_size, bits=bits)
        got = _dequant.dequantize(wv, sv, bv, group_size, bits)
        assert got.dtype == mx.float32 and got.shape == want.shape
        assert bool(mx.array_equal(got, want))
    assert (_dequant._kernel(bits) is not None) == (bits in _dequant.FUSED_BITS)
