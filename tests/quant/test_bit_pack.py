"""Bit packing: round trip for every width and odd lengths, and mx.quantize's exact word layout."""
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.quant.bit_pack import BitPackBuffer, pack, packed_bytes, packed_words, unpack


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
    codes = np.random.default_rng(0).integers(0, 32, size=(2, 3, 4, 33)).astype(np.uint8)
    p = pack(codes, 5)
    assert isinstance(p, np.ndarray) and p.shape == (2, 3, 4, packed_words(33, 5))
    np.testing.assert_array_equal(unpack(p, 5, 33), codes)
    buf = BitPackBuffer(5)
    pb = buf.pack(codes)
    assert isinstance(pb, np.ndarray) and pb.dtype == np.uint8 and pb.shape == (2, 3, 4, packed_bytes(33, 5))
    np.testing.assert_array_equal(buf.unpack(pb, 33), codes)
    pm = buf.pack(mx.array(codes.astype(np.uint32)))
    assert isinstance(pm, mx.array) and pm.dtype == mx.uint8
    np.testing.assert_array_equal(np.array(pm), pb)


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


# --- the seed's byte layout (issue 15) -------------------------------------------------------------
def _seed_stream_bytes(row, bits):
    """Reference: the LSB-first bit stream of one row, cut into ceil(n*bits/8) bytes."""
    stream = sum(int(v) << (bits * j) for j, v in enumerate(row))
    return [(stream >> (8 * i)) & 0xFF for i in range(packed_bytes(len(row), bits))]


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n=st.integers(0, 70), seed=st.integers(0, 2 ** 31))
def test_buffer_seed_byte_layout(bits, n, seed):
    codes = np.random.default_rng(seed).integers(0, 2 ** bits, size=(3, n)).astype(np.uint8)
    buf = BitPackBuffer(bits)
    packed = buf.pack(codes)
    assert packed.dtype == np.uint8 and packed.shape == (3, -(-n * bits // 8))
    assert [list(r) for r in packed] == [_seed_stream_bytes(r, bits) for r in codes]
    np.testing.assert_array_equal(buf.unpack(packed, n), codes)


def test_buffer_matches_seed_vectorized_unpack():
    # The seed's TurboQuantKVCache unpacks b in {1, 2, 4} with numpy shifts; our bytes must feed it.
    rng = np.random.default_rng(1)
    d = 64
    for b, shifts in ((2, [0, 2, 4, 6]), (4, [0, 4])):
        codes = rng.integers(0, 2 ** b, size=(5, d)).astype(np.uint8)
        block = np.stack([BitPackBuffer(b).pack(row) for row in codes])  # one row at a time, as the seed
        sh = np.array(shifts, dtype=np.uint8)
        seed_vals = ((block[:, :, None] >> sh[None, None, :]) & (2 ** b - 1)).reshape(5, -1)[:, :d]
        np.testing.assert_array_equal(seed_vals, codes)
    bits1 = rng.integers(0, 2, size=(5, 37)).astype(np.uint8)
    packed1 = BitPackBuffer(1).pack(bits1)
    np.testing.assert_array_equal(np.unpackbits(packed1, axis=1, bitorder="little")[:, :37], bits1)


def test_buffer_accepts_a_list():
    out = BitPackBuffer(4).pack([[1, 2, 3]])
    assert out.tolist() == [[0x21, 0x03]]


@pytest.mark.parametrize("codes", [[[16, 17, 3]], [[3, -1]], [[0, 255, 256]]])
def test_buffer_refuses_out_of_range_codes(codes):
    bits = 8 if 256 in codes[0] else 4
    with pytest.raises(ValueError, match="codes"):
        BitPackBuffer(bits).pack(codes)
    with pytest.raises(ValueError, match="codes"):
        BitPackBuffer(bits).pack(np.array(codes, dtype=np.int32))
    with pytest.raises(ValueError, match="codes"):
        pack(mx.array(codes, dtype=mx.int32), bits)


@settings(max_examples=40, deadline=None)
@given(bits=st.integers(1, 7), bad=st.one_of(st.integers(-300, -1), st.integers(1, 200)))
def test_pack_refuses_any_out_of_range_code(bits, bad):
    v = bad if bad < 0 else (1 << bits) - 1 + bad
    with pytest.raises(ValueError, match="codes"):
        pack(np.array([[0, v, 1]], dtype=np.int32), bits)


def test_buffer_unpack_errors():
    with pytest.raises(TypeError, match="packed"):
        BitPackBuffer(4).unpack(np.zeros((2, 2), dtype=np.uint32), 4)
    with pytest.raises(ValueError, match="packed"):
        BitPackBuffer(4).unpack(np.zeros((2, 1), dtype=np.uint8), 4)
    with pytest.raises(TypeError, match="codes"):
        BitPackBuffer(4).pack([[1.5, 2]])
