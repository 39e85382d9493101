"""`veloxquant_mlx.codecs._levels`: a codebook's levels as an exact odd polynomial of the code (or refused), and
`LevelDecoder` reading packed codes as level planes equal to a gather from the codebook."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest


def test_level_polynomials_are_exact_or_refused():
    from veloxquant_mlx.quant.codebooks import lloyd_max_codebook
    from veloxquant_mlx.codecs._levels import LevelDecoder, level_polynomial
    from veloxquant_mlx.quant.bit_pack import pack

    for bits in (1, 2, 3, 4):
        cb = lloyd_max_codebook("beta", bits, d=64)
        assert level_polynomial(cb.centroids_np, bits) is not None
        for d in (8, 56, 64):  # whole units only: one byte / 3 bytes hold 2, 4, 8 codes
            idx = mx.array(np.random.default_rng(bits).integers(0, 1 << bits, (1, 2, 5, d)).astype(np.uint8))
            dec = LevelDecoder([(cb.centroids_np, bits)], d)
            planes = dec(pack(idx, bits))
            step = len(planes)
            want = np.array(mx.take(cb.centroids, idx.astype(mx.int32)))
            for j, pl in enumerate(planes):
                np.testing.assert_allclose(np.array(pl), want[..., j::step], rtol=0, atol=1e-6 * np.abs(want).max())
    assert level_polynomial(lloyd_max_codebook("beta", 5, d=64).centroids_np, 5) is None  # beyond MAX_POLY_BITS
    assert level_polynomial(np.array([-1.0, 0.1, 0.5, 1.0]), 2) is None  # not symmetric
    assert not LevelDecoder([(lloyd_max_codebook("beta", 3, d=64).centroids_np, 3)], 60).exact  # 60 % 8 != 0


def test_plane_layout_units():
    from veloxquant_mlx.codecs._levels import plane_layout

    # (bytes per unit, codes per unit): 1 bit -> 1 byte of 8, 2 -> 1 of 4, 3 -> 3 of 8, 4 -> 1 of 2
    assert [plane_layout(b, 64) for b in (1, 2, 3, 4)] == [(1, 8), (1, 4), (3, 8), (1, 2)]
    assert plane_layout(3, 60) is None and plane_layout(4, 63) is None  # not whole units
    assert plane_layout(5, 64) is None  # 5 bytes a unit: too wide


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_code_packer_writes_the_packed_nearest_codes_and_planes_interleave_back(bits):
    from veloxquant_mlx.codecs._levels import CodePacker, LevelDecoder, interleave
    from veloxquant_mlx.quant.bit_pack import pack
    from veloxquant_mlx.quant.codebooks import lloyd_max_codebook, quantize_to_codebook

    cb = lloyd_max_codebook("beta", bits, d=64)
    y = mx.array(np.random.default_rng(bits).standard_normal((2, 3, 7, 64)).astype(np.float32) / 8)
    packer = CodePacker(cb.boundaries_np, bits, 64)
    assert packer.exact
    words = packer(y)
    assert words.dtype == mx.uint32 and bool(mx.array_equal(words, pack(quantize_to_codebook(y, cb), bits)))
    levels = interleave(LevelDecoder([(cb.centroids_np, bits)], 64)(words))
    want = mx.take(cb.centroids, quantize_to_codebook(y, cb).astype(mx.int32))
    np.testing.assert_allclose(np.array(levels), np.array(want), rtol=0, atol=1e-6)
    assert not CodePacker(cb.boundaries_np, bits, 63).exact  # not whole units
    with pytest.raises(RuntimeError, match="use quant.bit_pack.pack"):
        CodePacker(lloyd_max_codebook("beta", 5, d=64).boundaries_np, 5, 64)(y)
