"""Attention on packed codes (veloxquant_mlx.attention.packed_sdpa).

Reference everywhere: decode the same codes (codec.decode), concatenate with the exact window, and run
mx.fast.scaled_dot_product_attention with an explicit mask array. Differences are float32 rounding only.
The softmax exponential it uses: tests/attention/test_exp2.py.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import create_causal_mask

from veloxquant_mlx.attention.packed_sdpa import (CodedPart, ExactPart, attend_one_query, coded_attention,
                                                  packed_attention)
from veloxquant_mlx.codecs import AffineRotatedCodec, LloydMaxCodec
from _packed_attention_helpers import D, rand, make_codecs, setup, mask_for, assert_close


# -- equality with dequantize-then-SDPA -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["affine2", "affine4", "affine8", "block2", "block4", "block8", "mse", "prod", "rvq",
                                  "mse+outliers"])
@pytest.mark.parametrize("rep", [1, 3])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "window", "bool"])
@pytest.mark.parametrize("L", [1, 5])
def test_equals_dequantize_then_sdpa(kind, rep, mask_kind, L):
    B, Hkv = 2, 2
    kc, ka, vc, va, sink, recent, Kf, Vf = setup(kind, B, Hkv)
    Hq, N = Hkv * rep, Kf.shape[2]
    q = rand((B, Hq, L, D), 9)
    ours_mask, ref_mask = mask_for(mask_kind, B, Hq, L, N)
    scale = D ** -0.5
    out = coded_attention(q, kc, ka, vc, va, scale, ours_mask, sink=sink, recent=recent)
    ref = mx.fast.scaled_dot_product_attention(q, Kf, Vf, scale=scale, mask=ref_mask)
    assert out.shape == (B, Hq, L, D) and out.dtype == mx.float32
    assert_close(out, ref)


@pytest.mark.parametrize("kind", ["affine4", "block2", "prod+outliers"])
def test_coded_only_additive_mask_and_sinks(kind):
    B, Hkv, rep, L = 2, 2, 3, 5
    kc, ka, vc, va, _, _, Kf, Vf = setup(kind, B, Hkv, window=False)
    Hq, N = Hkv * rep, Kf.shape[2]
    q = rand((B, Hq, L, D), 4)
    m, _ = mask_for("additive", B, Hq, L, N)
    sinks = rand((Hq,), 5)
    out = coded_attention(q, kc, ka, vc, va, 0.3, m, sinks=sinks)
    ref = mx.fast.scaled_dot_product_attention(q, Kf, Vf, scale=0.3, mask=m, sinks=sinks)
    assert_close(out, ref)


@pytest.mark.parametrize("kind", ["affine4", "block4", "affine2"])
@pytest.mark.parametrize("packed_rows", [0, 10 ** 6])
@pytest.mark.parametrize("mask_kind", ["causal", "bool"])
def test_packed_and_dequantized_paths_agree(kind, packed_rows, mask_kind):
    """Quantized matmuls (decode) and dequantize-in-rotated-domain + BLAS (prefill) give the same result."""
    B, Hkv, rep, L = 2, 2, 3, 5
    kc, ka, vc, va, sink, recent, Kf, Vf = setup(kind, B, Hkv)
    q = rand((B, Hkv * rep, L, D), 6)
    ours_mask, ref_mask = mask_for(mask_kind, B, Hkv * rep, L, Kf.shape[2])
    out = coded_attention(q, kc, ka, vc, va, 0.2, ours_mask, sink=sink, recent=recent, packed_rows=packed_rows)
    ref = mx.fast.scaled_dot_product_attention(q, Kf, Vf, scale=0.2, mask=ref_mask)
    assert_close(out, ref)


def test_causal_window_size_equals_windowed_array():
    kc, ka, vc, va, sink, recent, Kf, Vf = setup("affine4")
    q = rand((2, 4, 5, D), 3)
    N = Kf.shape[2]
    a = coded_attention(q, kc, ka, vc, va, 0.2, "causal", sink=sink, recent=recent, window_size=6)
    b = coded_attention(q, kc, ka, vc, va, 0.2, create_causal_mask(5, N - 5, window_size=6), sink=sink, recent=recent)
    ref = mx.fast.scaled_dot_product_attention(q, Kf, Vf, scale=0.2, mask=create_causal_mask(5, N - 5, window_size=6))
    assert_close(a, ref)
    assert_close(b, ref)


def test_float16_queries_return_float16():
    kc, ka, vc, va, sink, recent, Kf, Vf = setup("affine4")
    q = rand((2, 2, 1, D), 1)
    out = coded_attention(q.astype(mx.float16), kc, ka, vc, va, 0.1, None, sink=sink, recent=recent)
    assert out.dtype == mx.float16
    ref = mx.fast.scaled_dot_product_attention(q, Kf, Vf, scale=0.1)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(ref), rtol=5e-3, atol=5e-3)


def test_dense_parts_only_and_mixed_codecs():
    """Exact parts alone equal SDPA; K and V may use different codec kinds."""
    K, V, q = rand((1, 2, 10, D), 0), rand((1, 2, 10, D), 1), rand((1, 4, 3, D), 2)
    out = packed_attention(q, [ExactPart(K[:, :, :4], V[:, :, :4]), ExactPart(K[:, :, 4:], V[:, :, 4:])], 0.2, "causal")
    ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=0.2, mask=create_causal_mask(3, 7))
    assert_close(out, ref)
    kc = AffineRotatedCodec(D, 4, seed=3)
    vc = LloydMaxCodec("turboquant_mse", D, 3, seed=4)
    kc.fit(K)
    vc.fit(V)
    ka, va = kc.encode(K), vc.encode(V)
    out = packed_attention(q, [CodedPart(kc, ka, vc, va)], 0.2)
    ref = mx.fast.scaled_dot_product_attention(q, kc.decode(ka, mx.float32), vc.decode(va, mx.float32), scale=0.2)
    assert_close(out, ref)


@settings(max_examples=15, deadline=None)
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 3), rep=st.integers(1, 3), L=st.integers(1, 4),
    n=st.integers(1, 20), n_sink=st.integers(0, 3), n_recent=st.integers(0, 5),
    bits=st.sampled_from([2, 3, 4, 8]), causal=st.booleans(), seed=st.integers(0, 1000),
)
def test_property_any_split_equals_sdpa(B, Hkv, rep, L, n, n_sink, n_recent, bits, causal, seed):
    d = 32
    K, V = rand((B, Hkv, n_sink + n + n_recent, d), seed, 0.5), rand((B, Hkv, n_sink + n + n_recent, d), seed + 1)
    kc, vc = AffineRotatedCodec(d, bits, seed=seed), AffineRotatedCodec(d, bits, seed=seed + 1)
    mid = slice(n_sink, n_sink + n)
    kc.fit(K[:, :, mid])
    vc.fit(V[:, :, mid])
    ka, va = kc.encode(K[:, :, mid]), vc.encode(V[:, :, mid])
    parts = [ExactPart(K[:, :, :n_sink], V[:, :, :n_sink]), CodedPart(kc, ka, vc, va),
             ExactPart(K[:, :, n_sink + n:], V[:, :, n_sink + n:])]
    Kf = mx.concatenate([K[:, :, :n_sink], kc.decode(ka, mx.float32), K[:, :, n_sink + n:]], axis=2)
    Vf = mx.concatenate([V[:, :, :n_sink], vc.decode(va, mx.float32), V[:, :, n_sink + n:]], axis=2)
    N = Kf.shape[2]
    L = min(L, N)
    q = rand((B, Hkv * rep, L, d), seed + 2)
    out = packed_attention(q, parts, 0.25, "causal" if causal else None)
    ref = mx.fast.scaled_dot_product_attention(q, Kf, Vf, scale=0.25, mask=create_causal_mask(L, N - L) if causal else None)
    assert_close(out, ref)


@pytest.mark.parametrize("second_centered", [False, True])
def test_coded_parts_with_different_value_means_equal_sdpa(second_centered):
    """Two coded parts whose value codecs differ (own mean, or none) take the per-part row-sum path."""
    d, n = 32, 40
    K, V = rand((1, 2, 2 * n + 5, d), 11, 0.5), rand((1, 2, 2 * n + 5, d), 12, 0.7)
    kc = AffineRotatedCodec(d, 4, seed=1)
    v1, v2 = AffineRotatedCodec(d, 4, seed=2), AffineRotatedCodec(d, 4, seed=3, center=second_centered)
    kc.fit(K[:, :, :n])
    v1.fit(V[:, :, :n])
    v2.fit(V[:, :, n : 2 * n])
    parts, ks, vs = [], [], []
    for vc, sl in ((v1, slice(0, n)), (v2, slice(n, 2 * n))):
        ka, va = kc.encode(K[:, :, sl]), vc.encode(V[:, :, sl])
        parts.append(CodedPart(kc, ka, vc, va))
        ks.append(kc.decode(ka, mx.float32))
        vs.append(vc.decode(va, mx.float32))
    parts.append(ExactPart(K[:, :, 2 * n :], V[:, :, 2 * n :]))
    Kf = mx.concatenate(ks + [K[:, :, 2 * n :]], axis=2)
    Vf = mx.concatenate(vs + [V[:, :, 2 * n :]], axis=2)
    q = rand((1, 4, 1, d), 13)
    out = packed_attention(q, parts, 0.3)
    assert_close(out, mx.fast.scaled_dot_product_attention(q, Kf, Vf, scale=0.3, mask=None))


@pytest.mark.parametrize("layout", ["exact", "coded", "sink+coded+tail", "two coded+tail"])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("kind", ["block8", "affine4", "mse"])
@pytest.mark.parametrize("route", ["softmax", "exp2"])
def test_attend_one_query_equals_general_path_and_sdpa(layout, with_sinks, kind, route, monkeypatch):
    """The decode fast path (what caches call per layer per step) computes what the general path does, and what
    SDPA on the decoded history does, for every mix of parts a cache builds, with attention-sink logits too, by
    both of its softmax routes (one fused softmax for short histories, the shared-max 2**t one beyond)."""
    from veloxquant_mlx.attention import packed_sdpa

    monkeypatch.setattr(packed_sdpa, "DECODE_SOFTMAX_TOKENS", 10 ** 6 if route == "softmax" else 0)
    B, Hkv, rep = 2, 3, 3
    kc, ka, vc, va, sink, recent, _, _ = setup(kind, B, Hkv)
    n = kc.n_tokens(ka)
    half = n // 2 if kc.token_block == 1 else kc.token_block
    kc2, vc2 = make_codecs(kind)
    K2, V2 = rand((B, Hkv, half, D), 21, 0.3), rand((B, Hkv, half, D), 22, 0.9)
    kc2.fit(K2)
    vc2.fit(V2)
    ka2, va2 = kc2.encode(K2), vc2.encode(V2)
    coded, coded2 = CodedPart(kc, ka, vc, va), CodedPart(kc2, ka2, vc2, va2)
    parts = {"exact": [ExactPart(*sink), ExactPart(*recent)], "coded": [coded],
             "sink+coded+tail": [ExactPart(*sink), coded, ExactPart(*recent)],
             "two coded+tail": [coded, coded2, ExactPart(*recent)]}[layout]
    ks = [p.keys if isinstance(p, ExactPart) else p.k_codec.decode(p.k_arrays, mx.float32) for p in parts]
    vs = [p.values if isinstance(p, ExactPart) else p.v_codec.decode(p.v_arrays, mx.float32) for p in parts]
    q = rand((B, Hkv * rep, 1, D), 23)
    sinks = rand((Hkv * rep,), 24) if with_sinks else None
    fast = attend_one_query(q, parts, 0.2, sinks)
    general = packed_attention(q, parts, 0.2, None, sinks=sinks, packed_rows=10 ** 6)  # not routed to the fast path
    ref = mx.fast.scaled_dot_product_attention(q, mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2), scale=0.2,
                                               sinks=sinks)
    assert fast.shape == (B, Hkv * rep, 1, D)
    np.testing.assert_allclose(np.array(fast), np.array(general), rtol=1e-4, atol=1e-5)
    assert_close(fast, ref)
    half_q = attend_one_query(q.astype(mx.float16), parts, 0.2, sinks)
    assert half_q.dtype == mx.float16

    # A batch's pad slots: per-part masks (None for a part every row fills) hide exactly what the concatenated
    # mask hides in the general path, and change nothing where they are all True.
    rng = np.random.default_rng(7)
    masks = [None if i == 0 else mx.array(rng.random((B, Hkv, 1, p.length)) < 0.7) for i, p in enumerate(parts)]
    if len(parts) == 1:
        masks = [mx.array(rng.random((B, Hkv, 1, parts[0].length)) < 0.7)]
    full = [mx.ones((B, Hkv, 1, p.length), mx.bool_) if m is None else m for m, p in zip(masks, parts)]
    for m in full:
        m[..., 0] = True  # every row sees at least one token of every part
    masks = [None if m is None else f for m, f in zip(masks, full)]
    grouped = mx.repeat(mx.concatenate(full, axis=-1), rep, axis=1)  # (B, Hq, 1, N): query heads r of KV head h
    fast = attend_one_query(q, parts, 0.2, sinks, masks)
    general = packed_attention(q, parts, 0.2, grouped, sinks=sinks, packed_rows=10 ** 6)
    np.testing.assert_allclose(np.array(fast), np.array(general), rtol=1e-4, atol=1e-5)
    everything = attend_one_query(q, parts, 0.2, sinks, [mx.ones((B, Hkv, 1, p.length), mx.bool_) for p in parts])
    np.testing.assert_allclose(np.array(everything), np.array(attend_one_query(q, parts, 0.2, sinks)), rtol=1e-6,
                               atol=1e-6)


# -- validation ---------------------------------------------------------------------------------
def test_bad_inputs_raise():
    kc, ka, vc, va, sink, recent, Kf, _ = setup("affine4", B=1, Hkv=2)
    q = rand((1, 4, 1, D), 0)
    with pytest.raises(ValueError, match="queries"):
        coded_attention(q[0], kc, ka, vc, va, 0.1)
    with pytest.raises(TypeError, match="queries"):
        coded_attention(np.zeros((1, 4, 1, D)), kc, ka, vc, va, 0.1)
    with pytest.raises(ValueError, match="mask"):
        coded_attention(q, kc, ka, vc, va, 0.1, "upper")
    with pytest.raises(ValueError, match="mask"):
        coded_attention(q, kc, ka, vc, va, 0.1, mx.ones((1, 4, 1, 5), dtype=mx.bool_))
    with pytest.raises(ValueError, match="KV heads"):
        coded_attention(rand((1, 3, 1, D), 0), kc, ka, vc, va, 0.1)
    with pytest.raises(ValueError, match="sinks"):
        coded_attention(q, kc, ka, vc, va, 0.1, sinks=mx.zeros((3,)))
    with pytest.raises(TypeError, match="k_codec"):
        coded_attention(q, object(), ka, vc, va, 0.1)
    with pytest.raises(ValueError, match="packed_rows"):
        coded_attention(q, kc, ka, vc, va, 0.1, packed_rows=-1)
    with pytest.raises(ValueError, match="window_size"):
        coded_attention(q, kc, ka, vc, va, 0.1, None, window_size=4)
    with pytest.raises(ValueError, match="at least one token"):
        packed_attention(q, [ExactPart(Kf[:, :, :0], Kf[:, :, :0])], 0.1)
