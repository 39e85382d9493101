"""The compiled kernel against its pure-MLX reference on every attention shape it now takes (issue 48).

Every test compares the kernel's output with `packed_sdpa.reference_one_query` (or the model run with the kernel
off) and checks with `kernel.calls()` that the kernel, not the reference, answered. Tolerance: both sides compute
in float32 and differ only in summation order (tiles of 32 tokens, threads' chunks, the online softmax's rescaling):
relative differences of a few float32 epsilons times the number of terms' square root, well under 1e-5 of the
output's magnitude for these histories (tests/attention/test_kernel.py uses the same bound). Outputs cast back to
float16 / bfloat16 queries may then round to neighbouring values: one unit in the last place of that dtype more.
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.attention import kernel
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart, reference_one_query
from veloxquant_mlx.codecs import CODECS
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.presets import DEFAULT_NAME, resolve_options

from _layouts import KBLOCK

TOL = 1e-5
ULP = {mx.float32: 0.0, mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}  # relative spacing of each dtype


def _close(out, ref, dtype=mx.float32):
    assert out.dtype == ref.dtype == dtype
    out, ref = np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32))
    assert out.shape == ref.shape
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(out, ref, rtol=TOL + ULP[dtype], atol=TOL * scale)
    if dtype != mx.float32:  # float32 results ~1e-6 apart round to the same half value but for a rare few
        assert np.mean(out != ref) < 0.05


def _rnd(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


class _Answered:
    """Counts the kernel's answers inside a ``with`` block; ``.n``: how many, refusals must stay 0."""

    def __enter__(self):
        self.before = kernel.calls()
        return self

    def __exit__(self, *exc):
        after = kernel.calls()
        self.n = after["kernel"] - self.before["kernel"]
        self.refused = after["refused"] - self.before["refused"]


def _fresh(parts):
    """New part objects over copied arrays, no ``within``: the reference attends each span as its own part."""
    return [CodedPart(p.k_codec, {f: mx.array(a) for f, a in p.k_arrays.items()}, p.v_codec,
                      {f: mx.array(a) for f, a in p.v_arrays.items()}) if isinstance(p, CodedPart) else
            ExactPart(mx.array(p.keys), mx.array(p.values)) for p in parts]


def _default_parts(d, R, n, H=2, B=1, dtype=mx.float32, seed=0):
    """The default layout's codes for head dim ``d`` (as `CacheOptions.for_dims` picks it) of ``n`` tokens, exact
    sink and tail tokens in ``dtype``, queries ``(B, H*R, 1, d)`` in ``dtype``."""
    o = resolve_options(DEFAULT_NAME).for_dims(d, d)
    kc, vc = CODECS[o.codec].make(o, d, d)
    k, v = _rnd((B, H, n, d), seed) * 1.5 + 0.7, _rnd((B, H, n, d), seed + 1)
    kc.fit(k)
    vc.fit(v)
    sink, tail = (_rnd((B, H, m, d), seed + 2 + m, dtype) for m in (4, 9))
    parts = [ExactPart(sink, sink * 0.5), CodedPart(kc, kc.encode(k), vc, vc.encode(v)), ExactPart(tail, -tail)]
    return _rnd((B, H * R, 1, d), seed + 99, dtype) * 2, parts, o


# -- GQA ratios and head dims: the default layout's codes ----------------------------------------------------------
@pytest.mark.parametrize("R", [1, 2, 3, 4, 6, 7, 8, 16])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_every_gqa_ratio_and_head_dim(R, d):
    """8-bit block keys and 4-bit values straight from the codes in row blocks for any R (Lloyd-Max codes at
    d = 80, which no affine group divides): equal to the reference, answered by the kernel."""
    q, parts, o = _default_parts(d, R, 192, seed=R + d)
    assert o.codec == ("lloyd_max" if d == 80 else "affine_block")
    with _Answered() as a:
        out = kernel.decode_step(q, parts, d ** -0.5)
    assert out is not None and a.n == 1 and a.refused == 0
    _close(out, reference_one_query(q, parts, d ** -0.5))


@pytest.mark.parametrize("R", [1, 4, 7, 16])
@pytest.mark.parametrize("d", [64, 96])
def test_every_row_plan_reads_the_same_codes(R, d):
    """Each way the kernel can read the default's codes (whole tiles or half tiles straight from the codes, or
    decoded once), for keys and values independently: all equal to the reference."""
    mod = kernel.compiled_module()
    q, parts, _ = _default_parts(d, R, 256, seed=3 * R + d)
    ref = reference_one_query(q, parts, d ** -0.5)
    try:
        for keys in (4, 2, 0):
            for values in (4, 2, 0):
                mod.set_row_plan(keys, values)
                with _Answered() as a:
                    out = kernel.decode_step(q, parts, d ** -0.5)
                assert a.n == 1, (keys, values)
                _close(out, ref)
    finally:
        mod.set_row_plan(-1, -1)
    with pytest.raises(ValueError, match="row plan"):
        mod.set_row_plan(3, 4)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("R,d", [(1, 64), (4, 128), (6, 96), (16, 256), (3, 80)])
def test_half_precision_queries_and_exact_tokens(dtype, R, d):
    q, parts, _ = _default_parts(d, R, 128, dtype=dtype, seed=R)
    assert parts[0].keys.dtype == dtype
    with _Answered() as a:
        out = kernel.decode_step(q, parts, d ** -0.5)
    assert a.n == 1
    _close(out, reference_one_query(q, parts, d ** -0.5), dtype)


# -- empty and one-token coded parts -------------------------------------------------------------------------------
@pytest.mark.parametrize("codec,n", [("affine", 0), ("affine", 1), ("lloyd_max", 0), ("lloyd_max", 1),
                                     ("affine_block", 0)])  # (block keys code whole 64-token blocks: no 1)
def test_empty_and_one_token_coded_parts(codec, n):
    """A coded part of no token (a cache before its first block: block keys) or of one (per-token codes) beside
    exact tokens."""
    d, R = 64, 3
    o = dataclasses.replace(resolve_options(DEFAULT_NAME), codec=codec, k_bits=4, v_bits=4).layer_options()
    kc, vc = CODECS[codec].make(o, d, d)
    fit_k, fit_v = _rnd((1, 2, 64, d), 1) + 0.3, _rnd((1, 2, 64, d), 2)
    kc.fit(fit_k)
    vc.fit(fit_v)
    if n:
        k_arrays, v_arrays = kc.encode(fit_k[:, :, :n]), vc.encode(fit_v[:, :, :n])
    else:
        k_arrays = kc.slice_tokens(kc.encode(fit_k), 0, 0)
        v_arrays = vc.slice_tokens(vc.encode(fit_v), 0, 0)
    coded = CodedPart(kc, k_arrays, vc, v_arrays)
    assert coded.length == n
    e = _rnd((1, 2, 5, d), 3)
    parts = [ExactPart(e[:, :, :2], e[:, :, :2] * 2), coded, ExactPart(e[:, :, 2:], -e[:, :, 2:])]
    q = _rnd((1, 2 * R, 1, d), 4) * 2
    with _Answered() as a:
        out = kernel.decode_step(q, parts, 0.125)
    assert a.n == 1
    # (the reference is given no empty part: MLX's quantized matmul over 0 tokens dies of SIGFPE; caches never
    # hand one to it)
    _close(out, reference_one_query(q, parts if n else [parts[0], parts[2]], 0.125))


# -- several coded parts: spans of one part's codes, small parts decoded -------------------------------------------
@pytest.mark.parametrize("codec,spans", [
    ("affine", [(0, 4), (37, 300)]),  # a window's kept prefix and its live codes
    ("affine", [(0, 1), (1, 2), (250, 251)]),  # one-token spans, adjacent spans
    ("affine_block", [(0, 64), (77, 256)]),  # codes grouped along tokens: a span starting inside a 32-token tile
    ("affine_block", [(5, 31), (33, 63), (200, 230)]),
])
def test_spans_of_one_coded_part_in_one_pass(codec, spans):
    """Parts that are slot ranges of one coded part (``within``) are read in one pass over its codes, skipping the
    slots between them; the reference attends the same tokens (decoded: block codes slice at block boundaries
    only)."""
    d, R, n = 64, 4, 256 if codec == "affine_block" else 320
    o = dataclasses.replace(resolve_options(DEFAULT_NAME), codec=codec).layer_options()
    kc, vc = CODECS[codec].make(o, d, d)
    k, v = _rnd((1, 2, n, d), 5) + 0.4, _rnd((1, 2, n, d), 6)
    kc.fit(k)
    vc.fit(v)
    whole = CodedPart(kc, kc.encode(k), vc, vc.encode(v))
    kd, vd = kc.decode(whole.k_arrays, mx.float32), vc.decode(whole.v_arrays, mx.float32)
    pieces = []
    for lo, hi in spans:  # (the arrays of a span part are never read by the kernel: the whole's are)
        pieces.append(CodedPart(kc, whole.k_arrays, vc, whole.v_arrays, within=(whole, lo, hi)))
    sink = _rnd((1, 2, 3, d), 7)
    q = _rnd((1, 2 * R, 1, d), 8) * 2
    with _Answered() as a:
        out = kernel.decode_step(q, [ExactPart(sink, sink)] + pieces, 0.125)
    assert a.n == 1
    ref = reference_one_query(q, [ExactPart(sink, sink)] + [ExactPart(kd[:, :, lo:hi], vd[:, :, lo:hi])
                                                            for lo, hi in spans], 0.125)
    _close(out, ref)


def test_a_second_per_token_coded_part_is_read_as_the_tail_a_third_small_one_decoded():
    """A per-token codec's old tail (a second coded part) is read from its codes in the same call (any length); a
    third coded part joins the exact tokens decoded when small, and leaves the step to the reference when long."""
    d, R = 64, 2
    o = dataclasses.replace(resolve_options(DEFAULT_NAME), codec="affine").layer_options()
    kc, vc = CODECS["affine"].make(o, d, d)
    k, v = _rnd((1, 2, 300, d), 9), _rnd((1, 2, 300, d), 10)
    kc.fit(k)
    vc.fit(v)
    main = CodedPart(kc, kc.encode(k[:, :, :280]), vc, vc.encode(v[:, :, :280]))
    old = CodedPart(kc, kc.encode(k[:, :, 280:286]), vc, vc.encode(v[:, :, 280:286]))
    parts = [main, old, ExactPart(k[:, :, 286:], v[:, :, 286:])]
    q = _rnd((1, 2 * R, 1, d), 11)
    with _Answered() as a:
        out = kernel.decode_step(q, parts, 0.125)
    assert a.n == 1
    _close(out, reference_one_query(q, parts, 0.125))
    long = CodedPart(kc, kc.encode(k[:, :, :kernel.DECODED_PART_TOKENS + 1]), vc,
                     vc.encode(v[:, :, :kernel.DECODED_PART_TOKENS + 1]))
    with _Answered() as a:
        out = kernel.decode_step(q, [main, long], 0.125)
    assert a.n == 1  # (longer than any decoded part: read as the tail)
    _close(out, reference_one_query(q, [main, long], 0.125))
    with _Answered() as a:
        out = kernel.decode_step(q, [main, long, old], 0.125)
    assert a.n == 1
    _close(out, reference_one_query(q, [main, long, old], 0.125))
    assert kernel.decode_step(q, [main, long, long], 0.125) is None


def _tailed_parts(d, R, B, n_blocks, n_tail, bits=4, seed=0, center=True):
    """``kblock_vsym8_pt`` codes: ``n_blocks`` key blocks of 128 tokens, then ``n_tail`` tokens coded per token by
    the block codec's provisional tail codec (a cache's coded tail), an exact sink token first; queries
    ``(B, H*R, 1, d)``."""
    o = CacheOptions(codec="kblock_vsym8_pt", k_bits=bits, v_bits=bits, group_size=128, center_keys=center,
                     center_values=center).layer_options()
    kc, vc = CODECS["kblock_vsym8_pt"].make(o, d, d)
    n = 128 * n_blocks
    k, v = _rnd((B, 2, n + n_tail, d), seed) * 1.5 + 0.7, _rnd((B, 2, n + n_tail, d), seed + 1)
    kc.fit(k[:, :, :n])
    vc.fit(v[:, :, :n])
    tk = kc.tail_codec()
    parts = [ExactPart(k[:, :, :1] * 0.3, v[:, :, :1]),
             CodedPart(kc, kc.encode(k[:, :, :n]), vc, vc.encode(v[:, :, :n])),
             CodedPart(tk, tk.encode(k[:, :, n:]), vc, vc.encode(v[:, :, n:]))]
    return _rnd((B, 2 * R, 1, d), seed + 2) * 2, parts


@pytest.mark.parametrize("d,R,B,n_tail,center", [(64, 3, 1, 100, True), (256, 4, 1, 127, True), (128, 1, 2, 200, False),
                                                 (64, 8, 2, 5, True), (96, 2, 1, 31, False)])
def test_a_coded_tail_is_read_from_its_codes_in_the_same_call(d, R, B, n_tail, center):
    """The budget layout with a coded tail (``kblock_vsym8_pt``): block codes, per-token provisional key codes and
    per-token value codes, centred or not, with a batch's pad-slot masks and attention sinks: one kernel call,
    equal to the reference."""
    q, parts = _tailed_parts(d, R, B, 2, n_tail, seed=d + R, center=center)
    masks = None
    if B == 2:  # row 1's last 3 tail slots are padding
        m = mx.array([[True] * n_tail, [True] * (n_tail - 3) + [False] * 3]).reshape(2, 1, 1, n_tail)
        masks = [None, None, m]
    sinks = _rnd((2 * R,), 7) if B == 1 else None
    with _Answered() as a:
        out = kernel.decode_step(q, parts, 0.125, sinks, masks)
    assert a.n == 1 and a.refused == 0
    _close(out, reference_one_query(q, parts, 0.125, sinks, masks))


def test_a_coded_tail_is_refused_with_a_clear_error_when_malformed():
    """The raw op checks the tail it is given: a wrong rotation shape or a mask of the wrong length is a
    ValueError naming it, never a crash."""
    q, parts = _tailed_parts(64, 2, 1, 1, 20)
    mod = kernel.compiled_module()
    tail = parts[2]
    arrays, layout, (kz, vz) = kernel._tail_arguments(tail, mod)
    args = kernel._coded_arguments(parts[1], mod)
    ka, va, second = args
    qq = mx.zeros((1, 2, 2, 64))
    ek, ev = mx.zeros((1, 2, 0, 64)), mx.zeros((1, 2, 0, 64))

    def call(tail_arrays):
        return mod.coded_decode_attention(
            qq, ka.rotation, va.rotation, ka.w, ka.scales, ka.biases, ka.tokens_last, ka.bits, ka.group, va.w,
            va.scales, va.biases, va.tokens_last, va.bits, va.group, float(va.zero), ek, ev, ka.mean, va.mean, None,
            None, None, ka.levels, va.levels, *second, tail=tail_arrays, tail_layout=layout, tail_k_zero=kz,
            tail_v_zero=vz)
    empty = mx.zeros((0,))
    mx.eval(call(arrays + [empty]))  # well formed: runs
    with pytest.raises(ValueError, match="tail rotations"):
        call(arrays[:6] + [mx.zeros((32, 32))] + arrays[7:] + [empty])
    with pytest.raises(ValueError, match="tail mask"):
        call(arrays + [mx.ones((2, 7), dtype=mx.bool_)])
    with pytest.raises(ValueError, match="tail keys"):
        call([arrays[0][:, :, :, :3]] + arrays[1:] + [empty])


@pytest.mark.parametrize("d,R,B,dims,traditional", [(64, 3, 1, 64, False), (128, 2, 2, 64, True), (96, 4, 2, 96, False)])
def test_a_key_offset_is_read_by_the_kernel_as_by_the_reference(d, R, B, dims, traditional):
    """Keys stored less their rotated mean before RoPE (``rope_offset``): the kernel turns each query back to every
    128-token block's first position and reads ``R_j mu`` from its table, for the blocks and the coded tail, at
    positions far from 0, per batch row (each row its own start): equal to the reference's score terms."""
    from veloxquant_mlx.attention.parts import KeyOffset
    from veloxquant_mlx.quant.rope import RopeFrame

    q, parts = _tailed_parts(d, R, B, 3, 70, seed=d + B)
    frame = RopeFrame(dims, traditional, tuple(float(x) for x in 10000.0 ** (-np.arange(0, dims, 2) / dims)))
    mu = _rnd((B * 2, d), 11) * 2
    starts = [5000 + 37 * b for b in range(B)]
    parts[1].key_offset = KeyOffset(frame, mu, mx.repeat(mx.array(starts, dtype=mx.int32), 2))
    parts[2].key_offset = KeyOffset(frame, mu, mx.repeat(mx.array([s + 384 for s in starts], dtype=mx.int32), 2))
    with _Answered() as a:
        out = kernel.decode_step(q, parts, 0.125)
    assert a.n == 1 and a.refused == 0
    want = reference_one_query(q, parts, 0.125)
    _close(out, want)
    plain = reference_one_query(q, parts[:1] + [dataclasses.replace(p, key_offset=None) for p in parts[1:]], 0.125)
    assert float(mx.abs(want - plain).max()) > 1e-2  # (the offset changes the answer: the check can fail)
    other = RopeFrame(dims, not traditional, frame.rates)  # a tail of another frame: the reference takes the call
    parts[2].key_offset = KeyOffset(other, mu, parts[2].key_offset.starts)
    assert kernel.decode_step(q, parts, 0.125) is None


def test_a_key_offset_is_refused_with_a_clear_error_when_malformed():
    q, parts = _tailed_parts(64, 2, 1, 1, 20)
    mod = kernel.compiled_module()
    ka, va, second = kernel._coded_arguments(parts[1], mod)
    qq = mx.zeros((1, 2, 2, 64))
    ek, ev = mx.zeros((1, 2, 0, 64)), mx.zeros((1, 2, 0, 64))
    table, turns, empty = mx.zeros((2, 4, 64, 32)), mx.zeros((2, 1, 64)), mx.zeros((0,))

    def call(arrays, layout=(64, 0, 128)):
        return mod.coded_decode_attention(
            qq, ka.rotation, va.rotation, ka.w, ka.scales, ka.biases, ka.tokens_last, ka.bits, ka.group, va.w,
            va.scales, va.biases, va.tokens_last, va.bits, va.group, float(va.zero), ek, ev, ka.mean, va.mean, None,
            None, None, ka.levels, va.levels, *second, key_offset=arrays, offset_layout=list(layout))
    mx.eval(call([table, turns, empty, empty]))  # well formed: runs
    with pytest.raises(ValueError, match="ctable"):
        call([table[:, :2], turns, empty, empty])
    with pytest.raises(ValueError, match="cturns"):
        call([table, turns[:, :, :32], empty, empty])
    with pytest.raises(ValueError, match="tail key offset"):
        call([table, turns, table, turns])
    with pytest.raises(ValueError, match="offset_layout"):
        call([table, turns, empty, empty], (63, 0, 128))


# -- sliding windows past eviction, through the cache ---------------------------------------------------------------
@pytest.mark.parametrize("window,keep,sink,recent,B", [
    (64, 4, 4, 0, 1),  # mlx_lm's max_kv_size layout: the live codes one slice after the evicted ones
    (64, 8, 4, 0, 1),  # keep > sink: kept codes, a hole, the live codes (two spans)
    (200, 4, 0, 0, 2),  # two sequences in lockstep (mlx_lm's KVCache holding a batch)
    (130, 8, 4, 6, 1),  # an exact recent window: the old tail a second, small coded part
    (512, 0, 0, 0, 1),  # Gemma 3's windows: keep 0
])
def test_rotating_cache_past_eviction_stays_on_the_kernel(window, keep, sink, recent, B):
    """A `TurboQuantRotatingPackedCache` (what enable() makes of mlx_lm's RotatingKVCache) decoding 300 tokens
    past its window: every step answered by the kernel, equal to the reference on the same tokens."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantRotatingPackedCache
    from veloxquant_mlx.integration.builder import _window_options
    from veloxquant_mlx.integration.routing import use_packed_attention

    H, R, d, steps = 2, 3, 64, 300
    options = dataclasses.replace(_window_options(resolve_options(DEFAULT_NAME), keep, "RotatingKVCache"),
                                  sink=sink, recent=recent)
    cache = TurboQuantRotatingPackedCache(options, max_size=window, keep=keep)
    n0 = window + 20
    multi = 0
    with use_packed_attention():
        cache.update_and_fetch(_rnd((B, H, n0, d), 1), _rnd((B, H, n0, d), 2))
        cache.attend_packed(_rnd((B, H * R, n0, d), 3), 0.125, "causal")
        with _Answered() as a:
            for s in range(steps):
                cache.update_and_fetch(_rnd((B, H, 1, d), 10 + s), _rnd((B, H, 1, d), 1000 + s))
                q = _rnd((B, H * R, 1, d), 5000 + s)
                out = cache.attend_packed(q, 0.125, None)
                parts = cache.attention_parts()
                multi += sum(isinstance(p, CodedPart) for p in parts) > 1
                ref = reference_one_query(q.reshape(1, B * H * R, 1, d), _fresh(parts), 0.125).reshape(out.shape)
                _close(out, ref)
    assert cache.rows.gone[0] > 0 or cache.rows.coded[0] <= window  # it evicted (codes dropped or a hole)
    assert a.n == steps and a.refused == 0
    if keep > sink or recent:
        assert multi >= steps - 1  # the cases that make several coded parts really made them (from the 2nd step)


# -- batches through mlx_lm's BatchGenerator (left-padded prompts) --------------------------------------------------
def _gemma(window):
    from mlx_lm.models import gemma3_text

    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", num_hidden_layers=2, head_dim=64, sliding_window=window, sliding_window_pattern=2,
        query_pre_attn_scalar=64, hidden_size=128, intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=128))
    mx.eval(model.parameters())
    return model


def _generate(model, prompts, max_tokens):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=8, prefill_batch_size=8)
    uids = gen.insert(prompts, [max_tokens] * len(prompts))
    tokens, logprobs = {u: [] for u in uids}, {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(np.array(r.logprobs))
    gen.close()
    return [tokens[u] for u in uids], [np.stack(logprobs[u]) for u in uids]


def test_left_padded_batch_with_sliding_windows_through_batch_generator(monkeypatch):
    """Gemma 3's layout (a 24-token sliding window, GQA 4) batched by mlx_lm's BatchGenerator, prompts of different
    lengths (left-padded), decoding past the window: the kernel answers every decode step of both layers, and the
    tokens and log-probabilities equal those with the kernel off (float32 summation order only)."""
    import veloxquant_mlx as vq
    from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache

    steps = []  # per decode step and layer: (cache kind, whether it holds codes, whether the kernel answered)
    real = TurboQuantBatchPackedCache._attend

    def counted(self, queries, *args, **kwargs):
        before = kernel.calls()["kernel"]
        out = real(self, queries, *args, **kwargs)
        if queries.shape[2] == 1 and kernel.enabled():
            steps.append((type(self).__name__, max(self.rows.coded) > 0, kernel.calls()["kernel"] > before))
            kernel.set_enabled(False)  # the same step on the reference: this layer's output, padded rows and all
            try:
                _close(out, real(self, queries, *args, **kwargs))
            finally:
                kernel.set_enabled(True)
        return out

    monkeypatch.setattr(TurboQuantBatchPackedCache, "_attend", counted)
    model = _gemma(24)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(1, 120, n)] for n in (5, 40, 70)]
    vq.enable(model)
    try:
        with _Answered() as a:
            got_tokens, got_lp = _generate(model, prompts, 40)

        previous = kernel.set_enabled(False)
        try:
            want_tokens, want_lp = _generate(model, prompts, 40)
        finally:
            kernel.set_enabled(previous)
    finally:
        vq.disable(model)
    # every decode step over codes, of both layers (the sliding one past its window, the full one), answered by the
    # kernel (the full layer's first steps hold exact tokens only, before its first 64-token block: the reference)
    coded = [(kind, answered) for kind, has_codes, answered in steps if has_codes]
    assert a.refused == 0 and all(answered for _, answered in coded) and a.n == len(coded)
    assert sum(kind == "TurboQuantBatchRotatingPackedCache" for kind, _ in coded) == len(steps) // 2 >= 39
    assert got_tokens == want_tokens
    for g, w in zip(got_lp, want_lp):
        np.testing.assert_allclose(g, w, atol=1e-4)  # (log-probabilities through two layers and the head)


# -- block keys coded in the model's own channels (key_rotation="none") ----------------------------------------------
@pytest.mark.parametrize("preset,d", [(DEFAULT_NAME, 64), (KBLOCK, 64), (KBLOCK, 256)])
def test_unrotated_block_keys(preset, d):
    """`CacheOptions.key_rotation="none"`: the keys' codec holds the identity, the values keep their rotation; the
    kernel reads those codes as the reference does, and both score the keys' own channels (the decoded keys match
    the codes' affine levels without a rotation)."""
    o = dataclasses.replace(resolve_options(preset), key_rotation="none").for_dims(d, d)
    kc, vc = CODECS[o.codec].make(o, d, d)
    assert kc.rotation.kind == "none" and vc.rotation.kind == "haar"
    B, H, R, n = 1, 2, 4, 256
    k, v = _rnd((B, H, n, d), 5) * 1.5 + 0.7, _rnd((B, H, n, d), 6)
    kc.fit(k)
    vc.fit(v)
    codes = kc.encode(k)
    # unrotated: what is coded is the keys themselves, and each channel's mean error is within its own block's step
    centred = k if kc.mean is None else k - kc.mean[None, :, None, :]
    np.testing.assert_array_equal(np.array(kc.rotate(k)), np.array(centred))
    err = np.abs(np.array(kc.decode(codes, mx.float32)) - np.array(k))
    span = np.array(k).reshape(B, H, n // kc.group_size, kc.group_size, d)
    step = (span.max(axis=3) - span.min(axis=3)) / (2 ** o.k_bits - 1)
    assert np.all(err.reshape(span.shape).mean(axis=3) <= step * 0.5)
    parts = [CodedPart(kc, codes, vc, vc.encode(v))]
    q = _rnd((B, H * R, 1, d), 7) * 2
    with _Answered() as a:
        out = kernel.decode_step(q, parts, d ** -0.5)
    assert out is not None and a.n == 1 and a.refused == 0
    _close(out, reference_one_query(q, parts, d ** -0.5))


# -- symmetric per-token keys as the coded part (k_zero) -------------------------------------------------------------
def test_symmetric_per_token_keys_are_read_as_the_coded_part(monkeypatch):
    """Keys coded as the values are (symmetric levels, one-byte scales, no biases: issue 54's research layout
    ``ksym8_vsym8``) are read by the kernel through ``k_zero``, as the reference reads them; without the zero level
    the scores would be off by ``zero * scale * sum(q)`` per group, which this check would see."""
    from veloxquant_mlx.codecs import CodecLayout
    from veloxquant_mlx.codecs.affine_sym_log import AffineSymLogScaleValueCodec
    from _kernel_helpers import _parts

    monkeypatch.setitem(CODECS, "ksym_test", CodecLayout(AffineSymLogScaleValueCodec, AffineSymLogScaleValueCodec))
    for bits in (3, 4):
        q, parts = _parts("ksym_test", bits, 200, seed=bits)
        coded = next(p for p in parts if isinstance(p, CodedPart))
        assert coded.k_codec.affine_codes(coded.k_arrays).zero != 0
        with _Answered() as a:
            out = kernel.decode_step(q, parts, 0.125)
        assert out is not None and a.n == 1 and a.refused == 0
        _close(out, reference_one_query(q, parts, 0.125))
