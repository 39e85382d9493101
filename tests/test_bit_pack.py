"""Bit packing: round trip for every width and odd lengths, and mx.quantize's exact word layout."""
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.dsa.bit_pack import BitPackBuffer, pack, packed_words, unpack


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 137), rows=st.integers(1, 4), seed=st.integers(0, 2 ** 31))
def test_roundtrip(bits, n, rows, seed):
    codes = np.random.default_rng(seed).integers(0, 2 ** bits, size=(rows, n)).astype(np.uint8)
    packed = pack(mx.array(codes), bits)
    assert packed.dtype == mx.uint32 and packed.shape == (rows, packed_words(n, bits))
    out = unpack(packed, bits, n)
    assert out.dtype == mx.uint8
    np.testing.assert_array_equal(np.array(out), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_matches_mx_quantize_words(bits, group_size):
    w = mx.array(np.random.default_rng(bits).standard_normal((6, 256)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=group_size, bits=bits, mode="affine")
    # recover the integer codes mx.quantize chose from its own dequantization
    wd = np.array(mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits, mode="affine"))
    s = np.repeat(np.array(scales), group_size, axis=1)
    b = np.repeat(np.array(biases), group_size, axis=1)
    codes = np.rint((wd - b) / s).astype(np.uint8)
    assert codes.max() < 2 ** bits
    np.testing.assert_array_equal(np.array(pack(mx.array(codes), bits)), np.array(wq))
    np.testing.assert_array_equal(np.array(unpack(wq, bits, 256)), codes)


def test_known_layout_lsb_first_straddle():
    # 3-bit values 1..7,0 repeating: value 10 (index 10) occupies bits 30..32 -> straddles words 0/1
    codes = np.arange(11, dtype=np.uint8) % 8
    words = np.array(pack(mx.array(codes), 3))
    stream = sum(int(v) << (3 * i) for i, v in enumerate(codes))
    assert words.tolist() == [stream & 0xFFFFFFFF, stream >> 32]


def test_batch_shapes_numpy_and_buffer():
    buf = BitPackBuffer(5)
    codes = np.random.default_rng(0).integers(0, 32, size=(2, 3, 4, 33)).astype(np.uint8)
    p = buf.pack(codes)
    assert isinstance(p, np.ndarray) and p.shape == (2, 3, 4, packed_words(33, 5))
    np.testing.assert_array_equal(buf.unpack(p, 33), codes)
    pm = buf.pack(mx.array(codes.astype(np.uint32)))
    assert isinstance(pm, mx.array)
    np.testing.assert_array_equal(np.array(pm), p)


def test_errors():
    with pytest.raises(ValueError, match="bits"):
        pack(mx.zeros((2, 4), dtype=mx.uint8), 9)
    with pytest.raises(TypeError, match="codes"):
        pack(mx.zeros((2, 4)), 4)
    with pytest.raises(TypeError, match="codes"):
        pack([1, 2, 3], 4)
    with pytest.raises(ValueError, match="words"):
        unpack(mx.zeros((2, 1), dtype=mx.uint32), 4, 16)
    with pytest.raises(ValueError, match="bits"):
        BitPackBuffer(0)
