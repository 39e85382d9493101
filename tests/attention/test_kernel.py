"""The compiled attention on codes (`veloxquant_mlx.attention.kernel`) against its pure-MLX reference.

`packed_sdpa.reference_one_query` is the reference: every codec layout the kernel reads (the codecs offering
``affine_codes``, TurboQuant-Prod's and RVQ's second code stream included), at several bit widths, head dims, GQA
groups, batches with pad slots, exact sink and tail tokens,
attention-sink logits and scale dtypes, agrees with it to 1e-5 of the output's magnitude in float32. The fallback
(kernel off, missing, built against another MLX, failing its first-use check) runs the reference with one warning,
and a model decodes the same logits either way. CI builds the kernel (scripts/setup.sh), so it must be available.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.attention import kernel, packed_sdpa
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart, reference_one_query
from _kernel_helpers import KERNEL_LAYOUTS, _parts, _close, _kernel, CASES, _reference_chunk


def test_the_kernel_is_built_and_used_here():
    """CI and scripts/setup.sh build it: a silent fallback would hide a broken build."""
    ok, what = kernel.status()
    assert ok, what
    assert "compiled kernel" in what


def test_kernel_layouts_are_the_affine_ones():
    assert set(KERNEL_LAYOUTS) == {"affine", "affine_block", "affine_block_kv", "affine_block_kv_mse", "kblock_vsym",
                                   "kblock_vsym8", "kblock_vsym8_pt", "lloyd_max", "kblock_vlloyd", "token_lloyd8"}


@pytest.mark.parametrize("codec,bits", CASES)
@pytest.mark.parametrize("n_blocks", [1, 9])
def test_parity_per_layout_and_bits(codec, bits, n_blocks):
    block = 128 if codec in ("kblock_vsym", "kblock_vsym8", "kblock_vlloyd") else 64
    gs = 128 if codec in ("kblock_vsym", "kblock_vsym8", "kblock_vlloyd") else None
    q, parts = _parts(codec, bits, n_blocks * block, group_size=gs, seed=bits)
    _close(_kernel(q, parts), reference_one_query(q, parts, 0.125))


@pytest.mark.parametrize("codec", ["affine_block", "kblock_vsym8", "lloyd_max"])
def test_a_nan_score_gives_nan_not_a_silently_finite_output(codec):
    """A query row whose scores are NaN yields NaN, as the reference does (the vector softmax must not clamp a NaN
    into a tiny weight); the other rows are unaffected."""
    gs = 128 if codec == "kblock_vsym8" else None
    q, parts = _parts(codec, 4, 256, group_size=gs, exact=False, seed=5)
    q = mx.where(mx.arange(q.shape[1]).reshape(1, -1, 1, 1) == 1, float("nan"), q)  # query head 1
    out, ref = np.array(_kernel(q, parts)), np.array(reference_one_query(q, parts, 0.125))
    assert np.isnan(ref[:, 1]).all() and np.isnan(out[:, 1]).all()
    keep = [h for h in range(q.shape[1]) if h != 1]
    _close(out[:, keep], ref[:, keep])


@pytest.mark.parametrize("d,R", [(32, 1), (64, 4), (128, 2)])
@pytest.mark.parametrize("codec", ["affine", "affine_block"])
def test_parity_head_dims_and_gqa_groups(d, R, codec):
    q, parts = _parts(codec, 4, 256 if codec == "affine" else 128, d=d, R=R, seed=d)
    _close(_kernel(q, parts, d ** -0.5), reference_one_query(q, parts, d ** -0.5))


@pytest.mark.parametrize("R", [1, 2, 3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_parity_default_codes_per_gqa_group(R, d):
    """The default's codes (8-bit block keys, 4-bit per-token values): for up to three query heads per KV head
    whole tiles are scored and weighted straight from the codes, for more half tiles in row blocks (or, values at
    R >= 8, decoded tiles; every R and plan: test_kernel_parity.py); equal to the reference."""
    q, parts = _parts("affine_block", 8, 3 * 64, v_bits=4, d=d, R=R, seed=R + d)
    assert parts[1].k_codec.bits == 8 and parts[1].v_codec.bits == 4
    _close(_kernel(q, parts, d ** -0.5), reference_one_query(q, parts, d ** -0.5))


@pytest.mark.parametrize("codec,bits,v_bits", [("affine_block", 8, 4), ("affine", 4, None), ("lloyd_max", 3, None)])
@pytest.mark.parametrize("R,L", [(3, 2), (3, 5), (3, 7), (1, 4), (4, 6)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_parity_short_causal_chunk(codec, bits, v_bits, R, L, with_sinks):
    """A short prompt chunk (the last L tokens stored, mlx_lm's causal mask) through the kernel: every coded token
    visible, one causal mask row per (query head, query) on the exact tokens, in pieces of at most MAX_ROWS rows
    (R=3, L=7: 5 + 2; R=4, L=6: 4 + 2); equal to the ops path, which packed_attention also takes."""
    _, parts = _parts(codec, bits, 128, v_bits=v_bits, R=R, seed=L + R)
    parts[-1] = ExactPart(*(mx.concatenate([a, a[:, :, :1] * 0.3], axis=2) for a in (parts[-1].keys, parts[-1].values)))
    B, H, d = 1, 2, 64
    q = mx.random.normal((B, H * R, L, d), key=mx.random.key(L)) * 2
    sinks = mx.random.normal((H * R,), key=mx.random.key(3)) if with_sinks else None
    out = packed_sdpa._short_chunk(q, parts, 0.125, sinks, R)
    assert out is not None, "the kernel declined a short chunk it reads"
    ref = _reference_chunk(q, parts, 0.125, sinks)
    _close(out, ref)
    _close(packed_sdpa.packed_attention(q, parts, 0.125, "causal", sinks=sinks), ref)


def test_a_chunk_longer_than_the_exact_tail_is_left_to_the_ops_path():
    """The kernel's chunk path needs the whole chunk in the last (exact) part: with 8 tail tokens a chunk of 9
    queries is declined (some of them would see a token of the chunk as coded), and packed_attention stays right."""
    q1, parts = _parts("affine_block", 8, 128, v_bits=4, R=3, seed=2)
    assert parts[-1].length == 7
    q = mx.random.normal((1, 6, 9, 64), key=mx.random.key(9))
    assert kernel.decode_step(q, parts, 0.125, chunk=True) is None
    assert kernel.decode_step(q[:, :, :5], parts, 0.125, chunk=True, later=4) is None
    assert kernel.decode_step(q[:, :, :5], parts, 0.125, chunk=True, later=2) is not None
    _close(packed_sdpa.packed_attention(q, parts, 0.125, "causal"), _reference_chunk(q, parts, 0.125))


@pytest.mark.parametrize("codec", ["affine_block", "kblock_vsym", "kblock_vsym8", "affine", "lloyd_max"])
def test_parity_batch_pad_slots_sinks_and_no_exact_tokens(codec):
    """A batch's per-row valid slots (masks per part, as the batch cache passes them), attention-sink logits
    (per query head, and tiled per row as a folded batch passes them), and a history of codes only."""
    gs = 128 if codec.startswith("kblock_vsym") else None
    B, H, R = 3, 2, 2
    q, parts = _parts(codec, 4, 768 if codec.startswith("kblock_vsym") else 640, B=B, H=H, R=R, group_size=gs, seed=5)
    rng = np.random.default_rng(3)
    masks = []
    for p in parts:
        m = rng.random((B, H, 1, p.length)) < 0.6
        m[..., 0] = True  # every row sees a token of every part
        masks.append(mx.array(m))
    masks[0] = None  # a part every row fills
    sinks = mx.random.normal((H * R,), key=mx.random.key(4))
    _close(_kernel(q, parts, 0.2, sinks, masks), reference_one_query(q, parts, 0.2, sinks, masks))
    _close(_kernel(q, parts, 0.2, sinks), reference_one_query(q, parts, 0.2, sinks))
    coded_only = [p for p in parts if isinstance(p, CodedPart)]
    _close(_kernel(q, coded_only, 0.2), reference_one_query(q, coded_only, 0.2))
    # folded batch: B rows as B*H heads of one row, sinks tiled per row
    qf = q.reshape(1, B * H * R, 1, q.shape[-1])
    fold = lambda a: a.reshape(1, B * H, *a.shape[2:])  # noqa: E731
    kc, vc = coded_only[0].k_codec, coded_only[0].v_codec
    for c in (kc, vc):
        if getattr(c, "mean", None) is not None:
            c.mean = mx.tile(c.mean, (B, 1))  # folded codecs hold per-row means (B*H, d)
    folded = [CodedPart(kc, {k: fold(a) for k, a in coded_only[0].k_arrays.items()}, vc,
                        {k: fold(a) for k, a in coded_only[0].v_arrays.items()})]
    st = mx.tile(sinks, (B,))
    _close(_kernel(qf, folded, 0.2, st), reference_one_query(qf, folded, 0.2, st))


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
def test_parity_scale_dtypes(scale_dtype):
    q, parts = _parts("affine", 4, 96, scale_dtype=scale_dtype)
    _close(_kernel(q, parts), reference_one_query(q, parts, 0.125))


def test_parity_long_history_split_over_threads():
    """Long histories are split into chunks across the worker threads and merged: same result."""
    q, parts = _parts("affine_block", 8, 64 * 70, H=3, R=3, seed=11)
    _close(_kernel(q, parts), reference_one_query(q, parts, 0.125))


@pytest.mark.parametrize("method", ["turboquant_prod", "turboquant_rvq"])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("n_blocks", [1, 9])
def test_parity_two_stream_codes(method, bits, n_blocks):
    """TurboQuant-Prod keys (the MSE codes plus the QJL signs scored in their sketch space) and RVQ keys and values
    (two codebooks under one norm) read as two code streams."""
    q, parts = _parts("lloyd_max", bits, n_blocks * 64, method=method, seed=bits + 20)
    ka = parts[1].k_codec.affine_codes(parts[1].k_arrays)
    assert ka is not None and ka.extra is not None  # the second stream is really read
    _close(_kernel(q, parts), reference_one_query(q, parts, 0.125))


@pytest.mark.parametrize("method", ["turboquant_prod", "turboquant_rvq"])
@pytest.mark.parametrize("d,R", [(32, 1), (128, 4)])
def test_parity_two_stream_codes_head_dims_batches_and_masks(method, d, R):
    B, H = 2, 2
    q, parts = _parts("lloyd_max", 4, 320, B=B, H=H, R=R, d=d, method=method, seed=d + R)
    rng = np.random.default_rng(d)
    masks = []
    for p in parts:
        m = rng.random((B, H, 1, p.length)) < 0.7
        m[..., 0] = True
        masks.append(mx.array(m))
    sinks = mx.random.normal((H * R,), key=mx.random.key(1))
    _close(_kernel(q, parts, d ** -0.5, sinks, masks), reference_one_query(q, parts, d ** -0.5, sinks, masks))


def test_parity_prod_with_a_sketch_shorter_than_the_head():
    q, parts = _parts("lloyd_max", 3, 128, method="turboquant_prod", jl_dim=32)
    assert parts[1].k_codec.affine_codes(parts[1].k_arrays).extra.rotation.shape == (32, 64)
    _close(_kernel(q, parts), reference_one_query(q, parts, 0.125))


def test_declines_what_it_does_not_read():
    """1-bit TurboQuant-Prod keys (no MSE stage), outlier channels, two long coded parts that are not slot ranges
    of one, per-query-row masks, head dims over 256: None (the caller runs the reference)."""
    q, parts = _parts("lloyd_max", 1, 64, method="turboquant_prod")
    assert kernel.decode_step(q, parts, 0.125) is None
    q, parts = _parts("lloyd_max", 4, 64, n_outlier_channels=8)
    assert kernel.decode_step(q, parts, 0.125) is None
    q, parts = _parts("affine_block", 8, 192, exact=False)  # (two coded parts over DECODED_PART_TOKENS: not one pass)
    assert parts[0].length > kernel.DECODED_PART_TOKENS
    assert kernel.decode_step(q, parts + parts, 0.125) is None
    m = mx.ones((1, 2, 3, 64), dtype=mx.bool_)
    assert kernel.decode_step(q, parts, 0.125, masks=[m]) is None
    q, parts = _parts("affine", 4, 8, d=512, exact=False)  # head dims over 256: the reference, not an error
    assert kernel.decode_step(q, parts, 0.125) is None


def test_raw_op_refuses_bad_arrays_with_a_clear_error():
    """Misshaped codes reach the C++ op's checks: a ValueError, never a crash."""
    mod = kernel._load()
    eye = mx.eye(32)
    q = mx.zeros((1, 1, 1, 32))
    kw, ks, kb = mx.quantize(mx.zeros((1, 1, 32, 64)), group_size=64, bits=8)
    vw, vs, vb = mx.quantize(mx.zeros((1, 1, 64, 32)), group_size=32, bits=4)
    e = mx.zeros((1, 1, 0, 32))
    with pytest.raises(ValueError, match="keys"):
        mod.coded_decode_attention(q, eye, eye, kw, ks[..., :0], kb, True, 8, 64, vw, vs, vb, False, 4, 32, 0.0,
                                   e, e, None, None, None, None, None)
    with pytest.raises(ValueError, match="values"):
        mod.coded_decode_attention(q, eye, eye, kw, ks, kb, True, 8, 64, vw[:, :, :10], vs, vb, False, 4, 32, 0.0,
                                   e, e, None, None, None, None, None)
    # a second stream: all of its arrays or none, per-token keys only, levels of the right size
    lev = mx.zeros((2,))
    with pytest.raises(ValueError, match="go together"):
        mod.coded_decode_attention(q, eye, eye, kw, ks, kb, True, 8, 64, vw, vs, vb, False, 4, 32, 0.0,
                                   e, e, None, None, None, None, None, None, None, kw, None, None, None, 1)
    with pytest.raises(ValueError, match="per-token keys"):
        mod.coded_decode_attention(q, eye, eye, kw, ks, kb, True, 8, 64, vw, vs, vb, False, 4, 32, 0.0,
                                   e, e, None, None, None, None, None, None, None, kw, ks, eye, lev, 1)
    with pytest.raises(ValueError, match="second value stream"):
        mod.coded_decode_attention(q, eye, eye, kw, ks, kb, True, 8, 64, vw, vs, vb, False, 4, 32, 0.0,
                                   e, e, None, None, None, None, None, None, None, v2w=vw, v2_levels=lev, v2_bits=1)
    with pytest.raises(ValueError, match="q must be float32"):
        mod.coded_decode_attention(q.astype(mx.float16), eye, eye, kw, ks, kb, True, 8, 64, vw, vs, vb, False, 4,
                                   32, 0.0, e, e, None, None, None, None, None)
