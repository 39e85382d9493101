"""``affine_block`` (`veloxquant_mlx.codecs.affine_block`): keys stored transposed, each rotated channel quantized
over blocks of tokens. The codes are ``mx.quantize`` of ``(Pi x)^T`` along tokens (the mean folded into the
biases), any head_dim works, a block holding a non-finite token decodes NaN (only that block), the restore checks
and block alignment are refused by name, and the fast score path equals the decoded math."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codecs.affine_block import AffineBlockKeyCodec


def _x(shape, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) + 1.5)


@pytest.mark.parametrize("d", [64, 40])  # groups run along tokens: a head_dim no group size divides works too
def test_codes_are_mx_quantize_along_tokens_with_the_mean_in_the_biases(d):
    x = _x((1, 2, 64, d))
    c = AffineBlockKeyCodec(d, 4, scale_dtype="float32")
    assert c.block == c.token_block == 64 and c.BLOCKED
    c.fit(x)
    codes = c.encode(x)
    assert codes["w_q"].shape == (1, 2, d, 64 * 4 // 32) and codes["scales"].shape == (1, 2, d, 1)
    assert c.decoded_offset() is None  # no q . mu term: Pi mu is in the biases
    # the mean is subtracted before quantizing, its rotation added back to the biases
    y = c.rotate(x)
    w, s, b = mx.quantize(mx.swapaxes(y, -1, -2), group_size=64, bits=4)
    offset = c.rotation.apply(c.mean)[None, :, :, None]
    assert bool(mx.array_equal(codes["w_q"], w))
    np.testing.assert_allclose(np.array(codes["biases"]), np.array(b + offset), rtol=1e-5, atol=1e-5)
    rel = float(mx.linalg.norm(c.decode(codes, mx.float32) - x) / mx.linalg.norm(x - c.mean[None, :, None, :]))
    assert rel < 0.15


def test_a_non_finite_token_spoils_only_its_own_block():
    x = _x((1, 1, 128, 64), 1)
    x[0, 0, 70, 5] = float("inf")
    c = AffineBlockKeyCodec(64, 4, center=False)
    y = np.array(c.decode(c.encode(x), mx.float32))
    assert np.all(np.isfinite(y[:, :, :64])) and not np.all(np.isfinite(y[:, :, 64:]))


def test_layout_checks_and_alignment_are_refused_by_name():
    c = AffineBlockKeyCodec(64, 2, 32)
    codes = c.encode(_x((2, 2, 96, 64), 2))
    assert c.n_tokens(codes) == 96 and c.n_tokens({}) == 0
    layout = c.code_layout(2)
    assert {f: F.shape(3, rows=2) for f, F in layout.items()} == {f: tuple(a.shape) for f, a in codes.items()}
    with pytest.raises(TypeError, match="codes blocks of tokens: see code_layout"):
        c.token_fields()
    with pytest.raises(ValueError, match=r"T=40 is not a multiple of block=32"):
        c.encode(_x((1, 2, 40, 64)))
    with pytest.raises(ValueError, match=r"token range \[0, 40\) must be aligned to block=32"):
        c.slice_tokens(codes, 0, 40)
    with pytest.raises(ValueError, match=r"restored: stored code arrays \['biases', 'w_q'\] must be exactly"):
        c.check_codes({"w_q": codes["w_q"], "biases": codes["biases"]}, "restored")
    with pytest.raises(ValueError, match=r"restored: arrays do not hold whole blocks of block=32 tokens"):
        c.check_codes({**codes, "scales": codes["scales"][..., :2], "biases": codes["biases"][..., :2]}, "restored")
    c.check_codes(codes, "restored")
    joined = c.concat([c.slice_tokens(codes, 0, 32), {}, c.slice_tokens(codes, 32, 96)])
    assert all(bool(mx.array_equal(joined[f], codes[f])) for f in codes)


@pytest.mark.parametrize("rows", [1, 3])
def test_fast_scores_equal_the_decoded_math(rows):
    x = _x((1, 2, 64, 64), 3)
    c = AffineBlockKeyCodec(64, 4)
    c.fit(x)
    codes = c.encode(x)
    k = c.decode(codes, mx.float32)
    q = mx.array(np.random.default_rng(4).standard_normal((1, 2, rows, 64)).astype(np.float32))
    for packed_rows in (0, 1000):
        np.testing.assert_allclose(np.array(c.scores(q, codes, packed_rows)), np.array(q @ mx.swapaxes(k, -1, -2)),
                                   rtol=1e-4, atol=2e-4)
    ac = c.affine_codes(codes)
    assert ac.tokens_last and ac.group == 64 and ac.mean is None
