"""The history's parts and what attention computes on each (veloxquant_mlx.attention.parts): lengths, masks restricted
to one part, scores, weighted values with a shared value offset, exact parts merged, and the short-history softmax,
each against the direct computation on the decoded tokens. The entry points over them:
tests/attention/test_packed_sdpa.py."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.attention import parts as P
from veloxquant_mlx.codecs import AffineRotatedCodec
from _packed_attention_helpers import rand

D = 32


def _coded(n, seed, center=True, v_codec=None):
    kc = AffineRotatedCodec(D, 8, seed=seed)
    vc = v_codec or AffineRotatedCodec(D, 8, seed=seed + 1, center=center)
    k, v = rand((1, 2, n, D), seed, 0.5), rand((1, 2, n, D), seed + 1, 0.7)
    kc.fit(k)
    vc.fit(v)
    return P.CodedPart(kc, kc.encode(k), vc, vc.encode(v))


def _decoded(p):
    if isinstance(p, P.ExactPart):
        return p.keys, p.values
    return p.k_codec.decode(p.k_arrays, mx.float32), p.v_codec.decode(p.v_arrays, mx.float32)


def test_lengths_and_heads_of_both_kinds():
    e = P.ExactPart(rand((1, 2, 5, D), 0), rand((1, 2, 5, 16), 1))
    c = _coded(7, 2)
    assert (e.length, c.length) == (5, 7) and c.within is None
    assert P._part_heads(e) == (1, 2, D) and P._part_heads(c) == (1, 2, D)


def test_causal_segment_masks():
    # queries are the last 3 of 10 keys: the first sees keys 0..7
    assert P._segment_mask("causal", 0, 8, 3, 10, None) is None  # every query sees this whole segment
    m = P._segment_mask("causal", 6, 10, 3, 10, None)
    assert np.array(m).astype(int).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    w = P._segment_mask("causal", 2, 10, 1, 10, 4)  # a window of 4: the last query sees keys 6..9
    assert np.array(w).astype(int).tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    assert P._segment_mask("causal", 6, 10, 1, 10, 4) is None and P._segment_mask(None, 0, 4, 1, 4, None) is None
    arr = mx.arange(10).reshape(1, 1, 1, 1, 10)
    assert P._segment_mask(arr, 3, 6, 1, 10, None).reshape(-1).tolist() == [3, 4, 5]  # (the slice of the part)


def test_grouped_masks_and_their_errors():
    assert P._grouped_mask(mx.ones((1, 6, 1, 5)), 2, 6, 2, 1, 5).shape == (1, 2, 3, 1, 5)  # per query head: grouped
    assert P._grouped_mask(mx.ones((5,)), 2, 6, 2, 1, 5).shape == (1, 1, 1, 1, 5)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 3, 1, 5\) does not broadcast to"):
        P._grouped_mask(mx.ones((2, 3, 1, 5)), 2, 6, 2, 1, 5)
    with pytest.raises(ValueError, match="mask must have 1 to 4 dims"):
        P._grouped_mask(mx.array(True), 2, 6, 2, 1, 5)


def test_masked_scores_are_the_finite_minimum_or_get_added():
    s = mx.zeros((1, 2, 6, 4))
    out = P._apply_mask(s, mx.array([[True, False, True, True]]), 3, 2)
    assert out[0, 0, 0].tolist() == [0.0, P.NEG, 0.0, 0.0] and P.NEG == float(np.finfo(np.float32).min)
    assert P._apply_mask(s, mx.full((1, 4), 0.5), 3, 2)[0, 1, 5].tolist() == [0.5] * 4
    assert P._apply_mask(s, None, 3, 2) is s


def test_scores_and_weighted_values_equal_the_decoded_math():
    q = rand((1, 2, 3, D), 10)  # grouped: (B, Hkv, R*L, d)
    parts = [P.ExactPart(rand((1, 2, 4, D), 11), rand((1, 2, 4, D), 12)), _coded(9, 13)]
    ks, vs = zip(*(_decoded(p) for p in parts))
    for p, k in zip(parts, ks):
        np.testing.assert_allclose(np.array(P.part_scores(q, p, None, 3, 1)), np.array(q @ mx.swapaxes(k, -1, -2)),
                                   rtol=1e-4, atol=1e-4)
    weights = [mx.abs(rand((1, 2, 3, p.length), 20 + i)) for i, p in enumerate(parts)]
    total = sum(mx.sum(w, axis=-1, keepdims=True) for w in weights)
    assert P._shared_offset(parts) is parts[1].v_codec.decoded_offset()  # (one value codec: its mean added once)
    got = P._weighted_values(weights, total, parts, None)
    want = sum(w @ v for w, v in zip(weights, vs))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_a_shared_offset_needs_one_value_codec():
    a, b = _coded(5, 30), _coded(5, 40)
    assert P._shared_offset([a, b]) is None  # two value codecs: each part adds its own
    assert P._shared_offset([P.ExactPart(mx.zeros((1, 2, 1, D)), mx.zeros((1, 2, 1, D)))]) is None


def test_exact_parts_merge_into_one_after_the_coded():
    e1 = P.ExactPart(rand((1, 2, 2, D), 50), rand((1, 2, 2, D), 51))
    e2 = P.ExactPart(rand((1, 2, 3, D), 52), rand((1, 2, 3, D), 53))
    c = _coded(4, 54)
    merged = P._merge_exact([e1, c, e2])
    assert merged[0] is c and isinstance(merged[1], P.ExactPart) and merged[1].length == 5
    assert mx.array_equal(merged[1].keys, mx.concatenate([e1.keys, e2.keys], axis=2)).item()
    one = [e1, c]
    assert P._merge_exact(one) is one  # (one exact part: as it is)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_the_short_softmax_is_softmax_over_every_part(with_sinks):
    R = 3
    q = rand((1, 2, R, D), 60)
    parts = [P.ExactPart(rand((1, 2, 2, D), 61), rand((1, 2, 2, D), 62)), _coded(9, 63),
             P.ExactPart(rand((1, 2, 3, D), 64), rand((1, 2, 3, D), 65))]
    ks, vs = zip(*(_decoded(p) for p in parts))
    scores = [q @ mx.swapaxes(k, -1, -2) * 0.2 for k in ks]
    sinks = rand((2 * R,), 66) if with_sinks else None
    got = P._short_softmax_values(scores, parts, sinks, 2, R)
    s = mx.concatenate(scores, axis=-1)
    if with_sinks:
        s = mx.concatenate([s, sinks.reshape(1, 2, R, 1)], axis=-1)
    w = mx.softmax(s, axis=-1, precise=True)[..., :sum(p.length for p in parts)]
    np.testing.assert_allclose(np.array(got), np.array(w @ mx.concatenate(vs, axis=2)), rtol=1e-4, atol=1e-5)
