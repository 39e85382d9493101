"""Attention on packed codes (veloxquant_mlx.attention.packed_sdpa) and the affine codecs.

Reference everywhere: decode the same codes (codec.decode), concatenate with the exact window, and run
mx.fast.scaled_dot_product_attention with an explicit mask array. Differences are float32 rounding only.
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
from veloxquant_mlx.codecs import AffineBlockKeyCodec, AffineRotatedCodec, LloydMaxCodec

D = 64
SINK, RECENT = 3, 4


def rand(shape, seed, offset=0.0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) + offset)


def make_codecs(kind: str, d: int = D):
    if kind.startswith("block"):  # block-layout keys, per-token affine values
        bits = int(kind[len("block"):])
        return AffineBlockKeyCodec(d, bits, seed=1), AffineRotatedCodec(d, bits, seed=2)
    if kind.startswith("affine"):
        bits = int(kind[len("affine"):])
        return AffineRotatedCodec(d, bits, seed=1), AffineRotatedCodec(d, bits, seed=2)
    method, _, outl = kind.partition("+")
    n_out = 8 if outl else 0
    return (LloydMaxCodec(f"turboquant_{method}", d, 3, seed=1, n_outliers=n_out),
            LloydMaxCodec(f"turboquant_{method}", d, 3, seed=2, n_outliers=n_out))


def setup(kind, B=2, Hkv=2, n=None, window=True, seed=0, d=D):
    """Coded history (keys with a channel offset, so centering matters) + optional exact window."""
    kc, vc = make_codecs(kind, d)
    n = n or (2 * kc.token_block if hasattr(kc, "token_block") and kc.token_block > 1 else 24)
    K, V = rand((B, Hkv, n, d), seed, offset=0.7), rand((B, Hkv, n, d), seed + 1, offset=-0.2)
    kc.fit(K)
    vc.fit(V)
    ka, va = kc.encode(K), vc.encode(V)
    sink = (rand((B, Hkv, SINK, d), seed + 2), rand((B, Hkv, SINK, d), seed + 3)) if window else None
    recent = (rand((B, Hkv, RECENT, d), seed + 4), rand((B, Hkv, RECENT, d), seed + 5)) if window else None
    ks, vs = [kc.decode(ka, mx.float32)], [vc.decode(va, mx.float32)]
    if window:
        ks, vs = [sink[0]] + ks + [recent[0]], [sink[1]] + vs + [recent[1]]
    return kc, ka, vc, va, sink, recent, mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)


def mask_for(kind, B, Hq, L, N, seed=0):
    """(mask given to ours, explicit mask array for the reference)."""
    if kind == "none":
        return None, None
    if kind == "causal":
        return "causal", create_causal_mask(L, N - L)
    if kind == "window":
        m = create_causal_mask(L, N - L, window_size=7)
        return m, m
    if kind == "bool":
        m = mx.array(np.random.default_rng(seed).random((B, 1, L, N)) > 0.3)
        m = m | (mx.arange(N) == N - 1)  # every query sees at least one key (SDPA is undefined otherwise)
        return m, m
    if kind == "additive":
        m = mx.array(np.random.default_rng(seed).standard_normal((B, Hq, L, N)).astype(np.float32))
        return m, m
    raise ValueError(kind)


def assert_close(out, ref):
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-3, atol=1e-4)


# -- the softmax exponential ------------------------------------------------------------------------
def test_exp2_nonpositive_matches_power_of_two():
    from veloxquant_mlx.attention.exp2 import exp2_nonpositive

    t = np.concatenate([-np.random.default_rng(0).uniform(0, 126, 200_000), [0.0, -0.5, -1.0, -64.0, -126.0]])
    want = np.exp2(t.astype(np.float32).astype(np.float64))
    for fused in (True, False):  # Estrin (fused kernel) and Horner (plain ops, prefill)
        got = np.array(exp2_nonpositive(mx.array(t.astype(np.float32)), fused=fused))
        assert got.dtype == np.float32
        assert np.max(np.abs(got / want - 1)) < 3e-6
        # Masked scores: far below the max, -inf, float32's most negative value -> exactly 0 (never NaN).
        masked = mx.array([-127.0, -500.0, -np.inf, float(np.finfo(np.float32).min)], mx.float32)
        assert np.array(exp2_nonpositive(masked, fused=fused)).tolist() == [0.0, 0.0, 0.0, 0.0]


def test_exp2_fused_equals_plain_ops():
    from veloxquant_mlx.attention import exp2

    t = mx.array(-np.random.default_rng(1).uniform(0, 140, (3, 5, 777)).astype(np.float32))
    fused = exp2.exp2_nonpositive(t)
    # (where mx.compile cannot build CPU kernels, exp2_nonpositive is the plain ops: the same check holds)
    assert mx.array_equal(fused, exp2.exp2_nonpositive_reference(t))


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


# -- AffineRotatedCodec ---------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("rotation", ["haar", "hadamard"])
def test_affine_codec_round_trip_and_bytes(bits, rotation):
    x = rand((2, 3, 50, D), 0, offset=2.0)
    c = AffineRotatedCodec(D, bits, seed=5, rotation=rotation)
    assert not c.fitted
    c.fit(x)
    assert c.fitted and c.mean.shape == (3, D)
    arrays = c.encode(x)
    assert set(arrays) == {"w_q", "scales", "biases"}
    for a in arrays.values():
        assert a.shape[:3] == (2, 3, 50)
    assert arrays["scales"].dtype == mx.float16
    per_token = sum(a.nbytes for a in arrays.values()) / (2 * 3 * 50)
    assert per_token == c.bytes_per_token_head()
    y = c.decode(arrays, mx.float32)
    rel = float(mx.linalg.norm(y - x) / mx.linalg.norm(x - c.mean[None, :, None, :]))
    assert rel < 2.0 ** (1 - bits)  # affine error halves with each bit (0.5 at 2 bits, ~0.008 at 8)
    # The rotation really is orthogonal and is what attention needs: stored = Pi (x - mu).
    pi = c.rotation_matrix
    np.testing.assert_allclose(np.array(pi @ pi.T), np.eye(D), atol=1e-5)
    np.testing.assert_allclose(np.array(c.rotate(x)), np.array((x - c.mean[None, :, None, :]) @ pi.T), atol=1e-4)


def test_affine_codec_state_and_options():
    x = rand((1, 2, 20, D), 1, offset=1.0)
    c = AffineRotatedCodec(D, 4, seed=2, scale_dtype="float32")
    c.fit(x)
    arrays = c.encode(x)
    assert arrays["scales"].dtype == mx.float32
    c2 = AffineRotatedCodec(D, 4, seed=2, scale_dtype="float32")
    c2.load_fitted(c.fitted_arrays())
    assert c2.fitted
    np.testing.assert_array_equal(np.array(c2.decode(arrays, mx.float32)), np.array(c.decode(arrays, mx.float32)))
    nc = AffineRotatedCodec(D, 4, center=False)
    assert nc.fitted and nc.fitted_arrays() == {}
    assert AffineRotatedCodec(32, 4).group_size == 32
    assert AffineRotatedCodec(128, 4).group_size == 64
    assert c.decode(arrays, mx.bfloat16).dtype == mx.bfloat16


@pytest.mark.parametrize(
    "kwargs, exc, word",
    [
        (dict(d=64, bits=7), ValueError, "bits"),
        (dict(d=64, bits=4.0), TypeError, "bits"),
        (dict(d=64, bits=4, group_size=16), ValueError, "group_size"),
        (dict(d=96, bits=4, group_size=64), ValueError, "multiple"),
        (dict(d=64, bits=4, rotation="fourier"), ValueError, "rotation"),
        (dict(d=64, bits=4, scale_dtype="int8"), ValueError, "scale_dtype"),
        (dict(d=64, bits=4, center=1), TypeError, "center"),
    ],
)
def test_affine_codec_validation(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        AffineRotatedCodec(**kwargs)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_block_key_codec(bits):
    x = rand((2, 3, 128, D), 2, offset=1.5)
    c = AffineBlockKeyCodec(D, bits, seed=3)
    assert c.token_block == 64 and AffineRotatedCodec(D, bits).token_block == 1
    c.fit(x)
    arrays = c.encode(x)
    assert arrays["w_q"].shape == (2, 3, D, 128 * bits // 32)  # K^T layout, token axis last
    assert arrays["scales"].shape == arrays["biases"].shape == (2, 3, D, 2)
    assert c.n_tokens(arrays) == 128
    assert sum(a.nbytes for a in arrays.values()) / (2 * 3 * 128) == c.bytes_per_token_head()
    y = c.decode(arrays, mx.float32)
    rel = float(mx.linalg.norm(y - x) / mx.linalg.norm(x - mx.mean(x, axis=2, keepdims=True)))
    assert rel < 2.0 ** (1 - bits)
    # The mean is folded into the biases: the rotated codes decode to Pi x itself, and centring never
    # hurts (it helps most at 2 bits, where the zero-point of MLX's affine format costs the most).
    np.testing.assert_allclose(np.array(c.rotation.invert(c.decode_rotated(arrays))), np.array(y), atol=1e-5)
    plain = AffineBlockKeyCodec(D, bits, seed=3, center=False)
    y_plain = plain.decode(plain.encode(x), mx.float32)
    assert float(mx.linalg.norm(y - x)) <= 1.02 * float(mx.linalg.norm(y_plain - x))
    # Blocks are independent: coding the halves apart and concatenating equals coding them together,
    # and slicing whole blocks back out gives each half.
    halves = [c.encode(x[:, :, i : i + 64]) for i in (0, 64)]
    joined = c.concat(halves)
    for name in arrays:
        np.testing.assert_array_equal(np.array(joined[name]), np.array(arrays[name]))
        np.testing.assert_array_equal(np.array(c.slice_tokens(arrays, 64, 128)[name]), np.array(halves[1][name]))
    # Used as values too (decoded: correct, not the fast path).
    q = rand((2, 6, 2, D), 3)
    out = packed_attention(q, [CodedPart(c, arrays, c, arrays)], 0.1, "causal")
    ref = mx.fast.scaled_dot_product_attention(q, y, y, scale=0.1, mask=create_causal_mask(2, 126))
    assert_close(out, ref)
    with pytest.raises(ValueError, match="multiple of block"):
        c.encode(x[:, :, :100])
    with pytest.raises(ValueError, match="whole blocks"):
        c.decode({k: a[..., :3] for k, a in arrays.items()}, mx.float32)
    with pytest.raises(ValueError, match="aligned"):
        c.slice_tokens(arrays, 0, 100)


def test_affine_codec_rejects_bad_tensors():
    c = AffineRotatedCodec(D, 4)
    with pytest.raises(ValueError, match="head_dim"):
        c.encode(mx.zeros((1, 1, 2, 32)))
    with pytest.raises(ValueError, match="shape"):
        c.fit(mx.zeros((2, D)))
    with pytest.raises(ValueError, match="missing"):
        c.decode({"w_q": mx.zeros((1, 1, 1, 8), dtype=mx.uint32)}, mx.float32)


# -- glue: a real packed cache's buffers ---------------------------------------------------------
def test_attend_packed_matches_fetch():
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
    from veloxquant_mlx.config import KVCacheConfig

    cache = TurboQuantPackedCache(KVCacheConfig(bit_width_inlier=3, n_outlier_channels=4), sink=2, recent=3)
    hist = None
    for step, T in enumerate([7, 1, 1, 4, 12, 1]):
        k, v = rand((1, 2, T, D), 10 + step, 0.5), rand((1, 2, T, D), 20 + step)
        hist = cache.update_and_fetch(k, v)
        q = rand((1, 6, T, D), 30 + step)
        mask = "causal" if T > 1 else None
        out = cache.attend_packed(q, 0.125, mask)
        ref = mx.fast.scaled_dot_product_attention(q, hist[0], hist[1], scale=0.125, mask=mask)
        assert_close(out, ref)
    kinds = [type(p).__name__ for p in cache.attention_parts()]
    # sink, codes, (tail tokens the cache reads as coded, if any), exact recent window
    assert cache.n_coded > 0
    assert kinds[:2] == ["ExactPart", "CodedPart"] and kinds[-1] == "ExactPart"


def test_attend_packed_of_rotating_cache_matches_fetch():
    from veloxquant_mlx.cache.packed_cache import TurboQuantRotatingPackedCache
    from veloxquant_mlx.config import KVCacheConfig

    cache = TurboQuantRotatingPackedCache(KVCacheConfig(bit_width_inlier=4), max_size=32, keep=2, sink=2, recent=3)
    for step, T in enumerate([20, 1, 16, 1, 1, 5, 1]):
        k, v = rand((1, 2, T, D), 40 + step, 0.5), rand((1, 2, T, D), 50 + step)
        mask = cache.make_mask(T, window_size=24)  # mlx_lm builds the mask before the update
        hist = cache.update_and_fetch(k, v)
        q = rand((1, 4, T, D), 60 + step)
        out = cache.attend_packed(q, 0.125, mask)
        ref_mask = create_causal_mask(T, hist[0].shape[2] - T) if isinstance(mask, str) else mask
        ref = mx.fast.scaled_dot_product_attention(q, hist[0], hist[1], scale=0.125, mask=ref_mask)
        assert_close(out, ref)
    assert cache.n_coded > 0
