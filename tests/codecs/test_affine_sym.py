"""``kblock_vsym`` values (`veloxquant_mlx.codecs.affine_sym`): symmetric scale-only codes per token. The packed
words are `quant.bit_pack`'s LSB-first stream, each group's scale is the clip candidate of least squared error
(never worse than the full range), and the codec decodes ``Pi^T (scale * (code - zero)) + mu`` with its own group
size whatever the keys' block."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codecs.affine_sym import CLIP_RATIOS, SYM_FIELDS, AffineSymValueCodec, pack_codes, symmetric_codes
from veloxquant_mlx.quant.bit_pack import pack


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_codes_is_the_bit_pack_stream(bits):
    q = mx.array(np.random.default_rng(bits).integers(0, 2 ** bits, (3, 64)).astype(np.uint8))
    assert bool(mx.array_equal(pack_codes(q, bits), pack(q, bits)))


@pytest.mark.parametrize("bits", [2, 4])
def test_symmetric_codes_take_the_least_error_clip(bits):
    rng = np.random.default_rng(bits)
    y = mx.array((rng.standard_normal((5, 128)) * rng.uniform(0.1, 4, (5, 1))).astype(np.float32))
    q, s = symmetric_codes(y, bits, 64)
    assert q.shape == y.shape and s.shape == (5, 2)
    qn = np.array(q)
    assert qn.min() >= 0 and qn.max() <= 2 ** bits - 1 and np.all(qn == np.round(qn))
    c = (2 ** bits - 1) / 2
    g = np.array(y).reshape(5, 2, 64)
    err = ((np.array(s)[..., None] * (qn.reshape(5, 2, 64) - c) - g) ** 2).sum(-1)
    amax = np.abs(g).max(-1, keepdims=True)
    for r in CLIP_RATIOS:  # no candidate does better
        sr = r * amax / c
        qr = np.clip(np.round(g / sr + c), 0, 2 ** bits - 1)
        assert np.all(err <= ((sr * (qr - c) - g) ** 2).sum(-1) * (1 + 1e-5) + 1e-12)


def test_codec_decodes_its_symmetric_codes():
    x = mx.array(np.random.default_rng(0).standard_normal((1, 2, 7, 64)).astype(np.float32) + 1.0)
    c = AffineSymValueCodec(64, 4, group_size=128)  # the keys' block: these groups stay 64
    assert c.group_size == 64 and c.zero == 7.5
    c.fit(x)
    codes = c.encode(x)
    assert sorted(codes) == sorted(SYM_FIELDS) and codes["scales"].dtype == mx.float16
    assert sum(a.nbytes for a in codes.values()) == 2 * 7 * c.bytes_per_token_head() == 2 * 7 * (32 + 2)
    q, s = symmetric_codes(c.rotate(x), 4, 64)
    assert bool(mx.array_equal(codes["w_q"], pack_codes(q, 4)))
    rot = (mx.repeat(codes["scales"].astype(mx.float32), 64, axis=-1)) * (q - 7.5)
    want = c.rotation.invert(rot) + c.mean[None, :, None, :]
    np.testing.assert_allclose(np.array(c.decode(codes, mx.float32)), np.array(want), rtol=1e-5, atol=1e-5)
    assert float(mx.linalg.norm(c.decode(codes, mx.float32) - x) / mx.linalg.norm(x - c.mean[None, :, None, :])) < 0.15
    ac = c.affine_codes(codes)
    assert ac.biases is None and ac.zero == 7.5 and ac.group == 64
    with pytest.raises(ValueError, match=r"codes must hold \('w_q', 'scales'\), missing \['scales'\]"):
        c.decode({"w_q": codes["w_q"]}, mx.float32)
