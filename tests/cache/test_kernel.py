"""The compiled attention on codes (`veloxquant_mlx.attention.kernel`) against its pure-MLX reference.

`packed_sdpa.reference_one_query` is the reference: every codec layout the kernel reads (the codecs offering
``affine_codes``, TurboQuant-Prod's and RVQ's second code stream included), at several bit widths, head dims, GQA
groups, batches with pad slots, exact sink and tail tokens,
attention-sink logits and scale dtypes, agrees with it to 1e-5 of the output's magnitude in float32. The fallback
(kernel off, missing, built against another MLX, failing its first-use check) runs the reference with one warning,
and a model decodes the same logits either way. CI builds the kernel (scripts/setup.sh), so it must be available.
"""
from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.attention import kernel, packed_sdpa
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart, attend_one_query, reference_one_query
from veloxquant_mlx.codecs import CODECS
from veloxquant_mlx.options import CacheOptions

# layouts the kernel reads: keys and values both offer affine_codes
KERNEL_LAYOUTS = [name for name, lay in CODECS.items()
                  if hasattr(lay.keys, "affine_codes") and hasattr(lay.values, "affine_codes")]


def test_the_kernel_is_built_and_used_here():
    """CI and scripts/setup.sh build it: a silent fallback would hide a broken build."""
    ok, what = kernel.status()
    assert ok, what
    assert "compiled kernel" in what


def test_kernel_layouts_are_the_affine_ones():
    assert set(KERNEL_LAYOUTS) == {"affine", "affine_block", "affine_block_kv", "affine_block_kv_mse", "kblock_vsym",
                                   "kblock_vsym8", "kblock_vsym8_pt", "lloyd_max", "kblock_vlloyd"}


def _parts(codec: str, bits: int, n: int, *, B=1, H=2, R=3, d=64, exact=True, seed=0, group_size=None,
           scale_dtype=None, v_bits=None, **options):
    o = CacheOptions(codec=codec, k_bits=bits, v_bits=v_bits or bits, group_size=group_size, **options).layer_options()
    kc, vc = CODECS[codec].make(o, d, d)
    if scale_dtype is not None:
        for c in (kc, vc):
            c.scale_dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16}[scale_dtype]
    keys = [mx.random.normal((B, H, n, d), key=mx.random.key(seed + i)) for i in range(2)]
    k, v = keys[0] * 1.5 + 0.7, keys[1]
    kc.fit(k)
    vc.fit(v)
    parts = [CodedPart(kc, kc.encode(k), vc, vc.encode(v))]
    if exact:
        e = [mx.random.normal((B, H, m, d), key=mx.random.key(seed + 10 + m)) for m in (4, 7)]
        parts = [ExactPart(e[0], e[0] * 0.5)] + parts + [ExactPart(e[1], -e[1])]
    q = mx.random.normal((B, H * R, 1, d), key=mx.random.key(seed + 99)) * 2
    return q, parts


def _close(out, ref, tol=1e-5):
    out, ref = np.array(out), np.array(ref)
    assert out.shape == ref.shape
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


def _kernel(q, parts, scale=0.125, sinks=None, masks=None):
    out = kernel.decode_step(q, parts, scale, sinks, masks)
    assert out is not None, "the kernel declined a case it reads"
    return out


CASES = [(c, b) for c in KERNEL_LAYOUTS for b in (2, 3, 4, 8) if b in CODECS[c].keys.BITS and b in CODECS[c].values.BITS
         and not (c in ("lloyd_max", "kblock_vlloyd") and b == 8)]  # (8-bit Lloyd-Max: a 256-level codebook, slow fit)


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


def _reference_chunk(q, parts, scale, sinks=None):
    previous = kernel.set_enabled(False)
    try:
        return packed_sdpa.packed_attention(q, parts, scale, "causal", sinks=sinks)
    finally:
        kernel.set_enabled(previous)


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


# -- the fallback -------------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """The module's load state, restored afterwards."""
    for name in ("_module", "_reason", "_warned"):
        monkeypatch.setattr(kernel, name, getattr(kernel, name))
    monkeypatch.setattr(kernel, "_refusals", {})  # (each kind of refusal warns once: a fresh count per test)
    yield


def test_turned_off_runs_the_reference_exactly():
    q, parts = _parts("affine_block", 8, 128)
    previous = kernel.set_enabled(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # turned off on purpose: no warning
            out = attend_one_query(q, parts, 0.125)
        assert kernel.status()[0] is False and "turned off" in kernel.status()[1]
    finally:
        kernel.set_enabled(previous)
    assert mx.array_equal(out, reference_one_query(q, parts, 0.125))
    with pytest.raises(TypeError, match="flag"):
        kernel.set_enabled("yes")


def _falls_back_with_one_warning(monkeypatch, match: str) -> None:
    """With the kernel module reloaded, a step runs on the reference with one warning matching ``match`` (not one
    per step), and gives the reference's output."""
    monkeypatch.setattr(kernel, "_module", None)
    monkeypatch.setattr(kernel, "_reason", None)
    monkeypatch.setattr(kernel, "_warned", False)
    q, parts = _parts("affine_block", 8, 128)
    with pytest.warns(RuntimeWarning, match=match):
        out = attend_one_query(q, parts, 0.125)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per step
        attend_one_query(q, parts, 0.125)
    assert mx.array_equal(out, reference_one_query(q, parts, 0.125))


def test_missing_or_mismatched_module_falls_back_with_one_warning(fresh_kernel_state, monkeypatch):
    import sys
    import types

    fake = types.ModuleType("veloxquant_mlx.attention._coded_attention")
    fake.built_with_mlx = "0.0.1"
    monkeypatch.setitem(sys.modules, "veloxquant_mlx.attention._coded_attention", fake)
    _falls_back_with_one_warning(monkeypatch, "built against MLX 0.0.1")
    assert kernel.status()[0] is False and "rebuild" in kernel.status()[1]
    assert "python -m veloxquant_mlx.attention.build_kernel" in kernel.status()[1]  # (the command, named)


def _load_fake(monkeypatch, **functions) -> str:
    """Loads a stand-in extension module (built for this MLX) holding ``functions``; returns why it was refused."""
    import sys
    import types

    from veloxquant_mlx.attention._sources import source_hash

    fake = types.ModuleType("veloxquant_mlx.attention._coded_attention")
    fake.built_with_mlx = mx.__version__
    fake.built_from_sources = source_hash()
    for name, fn in functions.items():
        setattr(fake, name, fn)
    monkeypatch.setitem(sys.modules, "veloxquant_mlx.attention._coded_attention", fake)
    monkeypatch.setattr(kernel, "_module", None)
    monkeypatch.setattr(kernel, "_reason", None)
    monkeypatch.setattr(kernel, "_warned", True)
    assert kernel._load() is None
    return kernel._reason


def test_a_module_built_from_other_sources_is_refused(fresh_kernel_state, monkeypatch):
    """A kernel built before the sources changed (a checkout updated since) is not used: it would be called with
    arguments it does not know. The module built here carries the digest of these very sources."""
    from veloxquant_mlx.attention._sources import source_hash
    assert kernel.compiled_module().built_from_sources == source_hash()
    real = kernel.compiled_module()
    reason = _load_fake(monkeypatch, coded_decode_attention=real.coded_decode_attention, built_from_sources="0" * 16)
    assert "other sources" in reason and "rebuild" in reason


def test_the_build_flags_run_on_any_avx2_x86_64_and_are_recorded(monkeypatch):
    """No -march=native: AVX2 / FMA / F16C on x86-64, nothing on arm64; the module carries the flags it was built
    with, readable from its file before it is imported."""
    import importlib.util

    from veloxquant_mlx.attention import build_kernel
    monkeypatch.delenv("VELOXQUANT_ARCH_FLAGS", raising=False)
    assert build_kernel.arch_flags("x86_64") == build_kernel.arch_flags("AMD64") == ["-mavx2", "-mfma", "-mf16c"]
    assert build_kernel.arch_flags("arm64") == build_kernel.arch_flags("aarch64") == []
    monkeypatch.setenv("VELOXQUANT_ARCH_FLAGS", "-march=native -O2")
    assert build_kernel.arch_flags("x86_64") == ["-march=native", "-O2"]
    mod = kernel.compiled_module()
    recorded = kernel._binary_flags(importlib.util.find_spec(kernel.MODULE).origin)
    assert recorded == mod.built_with_flags.split()
    assert "-march=native" not in recorded  # (CI and setup.sh build with the defaults)
    assert list(mod.missing_cpu_features()) == []  # this CPU runs it (it just did)


def test_a_cpu_lacking_the_built_extensions_is_refused_before_import(fresh_kernel_state, monkeypatch):
    """On an x86 CPU without AVX2 (as /proc/cpuinfo says) the module is not even imported: the reference runs, with
    one warning naming what is missing."""
    monkeypatch.setattr(kernel, "_binary_flags", lambda path: ["-mavx2", "-mfma", "-mf16c"])  # (the x86 build's)
    monkeypatch.setattr(kernel, "_cpu_flags", lambda: {"sse2", "avx", "fma", "f16c"})
    _falls_back_with_one_warning(monkeypatch, "lacks avx2")
    assert kernel.status()[0] is False and "lacks avx2" in kernel.status()[1]


def test_a_module_reporting_missing_cpu_features_is_refused(fresh_kernel_state, monkeypatch):
    """The module's own check after the import (__builtin_cpu_supports on the features it was compiled for)."""
    real = kernel.compiled_module()
    reason = _load_fake(monkeypatch, coded_decode_attention=real.coded_decode_attention,
                        missing_cpu_features=lambda: ["avx2", "fma"])
    assert "lacks avx2, fma" in reason


def test_a_module_that_computes_garbage_is_refused(fresh_kernel_state, monkeypatch):
    reason = _load_fake(monkeypatch, coded_decode_attention=lambda q, *a: mx.zeros((1, 2, 2, 32)))
    assert "first-use check" in reason


def test_a_module_whose_encoding_is_wrong_is_refused(fresh_kernel_state, monkeypatch):
    """The first-use check covers the codecs' encoding: attention right, encoding wrong -> not used."""
    real = kernel.compiled_module()
    wrong = lambda *args: [a + 1 if a.dtype != mx.uint32 else a for a in real.affine_encode(*args)]  # noqa: E731
    reason = _load_fake(monkeypatch, coded_decode_attention=real.coded_decode_attention, affine_encode=wrong)
    assert "encoding" in reason


def test_a_module_whose_row_gather_is_wrong_is_refused(fresh_kernel_state, monkeypatch):
    """The first-use check covers the batch caches' row gather: attention right, gather wrong -> not used."""
    real = kernel.compiled_module()
    wrong = lambda arrays, rows, folds: real.gather_rows(arrays, list(reversed(rows)), folds)  # noqa: E731
    reason = _load_fake(monkeypatch, coded_decode_attention=real.coded_decode_attention, gather_rows=wrong)
    assert "row gather" in reason


def _fresh(parts):
    """New part objects over copied arrays (of a `Rows.copy`, which keeps no view): nothing a step kept applies."""
    return [CodedPart(p.k_codec, {f: mx.array(a) for f, a in p.k_arrays.items()}, p.v_codec,
                      {f: mx.array(a) for f, a in p.v_arrays.items()}) if isinstance(p, CodedPart) else
            ExactPart(mx.array(p.keys), mx.array(p.values)) for p in parts]


@pytest.mark.parametrize("name", ["tq-affine-k8v4", "tq-prod-k4v4", "tq-3b"])
def test_what_the_kernel_keeps_between_steps_follows_the_cache(name):
    """Decode steps reuse the coded part and the kernel's view of it until the cache codes its next tokens: through
    blocks coded, trims into the codes (slots written again), and a batch of two rows coding at different steps,
    every step equals the reference on freshly built parts."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache, TurboQuantPackedCache, _folded_part_masks
    from veloxquant_mlx.integration import use_packed_attention

    H, R, d = 2, 3, 64
    rnd = lambda shape, i: mx.random.normal(shape, key=mx.random.key(i))  # noqa: E731
    caches = [TurboQuantPackedCache(name) for _ in range(2)]
    with use_packed_attention():
        for j, c in enumerate(caches):
            n = 150 + 101 * j  # (the rows code their blocks at different steps)
            c.update_and_fetch(rnd((1, H, n, d), 10 + j), rnd((1, H, n, d), 20 + j))
            c.attend_packed(rnd((1, H * R, n, d), 30 + j), 0.125, "causal")
        one, coded_steps, reused = caches[0], 0, 0
        for step in range(140):
            if step % 45 == 44:
                one.trim(70)  # into the codes: their slots are written again
            one.update_and_fetch(rnd((1, H, 1, d), 100 + step), rnd((1, H, 1, d), 400 + step))
            before = [p for p in one.rows.row_parts(0) if isinstance(p, CodedPart)]
            q = rnd((1, H * R, 1, d), 700 + step)
            out = one.attend_packed(q, 0.125, None)
            after = [p for p in one.rows.row_parts(0) if isinstance(p, CodedPart)]
            coded_steps += bool(before)
            reused += bool(before) and all(a is b for a, b in zip(after, before))
            _close(out, reference_one_query(q, _fresh(one.rows.copy().row_parts(0)), 0.125))
        assert coded_steps > 100 and reused == coded_steps  # (the memo is used, not rebuilt, within a step)
        batch = TurboQuantBatchPackedCache.merge(caches)
        for step in range(70):
            batch.update_and_fetch(rnd((2, H, 1, d), 900 + step), rnd((2, H, 1, d), 1200 + step))
            q = rnd((2, H * R, 1, d), 1500 + step)
            out = batch.attend_packed(q, 0.125, None)
            ref = reference_one_query(q.reshape(1, 2 * H * R, 1, d), _fresh(batch.rows.copy().attention_parts()), 0.125,
                                      masks=_folded_part_masks(batch.rows))
            _close(out, ref.reshape(out.shape))


# -- through a model ----------------------------------------------------------------------------------------------
def test_a_model_decodes_the_same_logits_with_and_without_the_kernel(tiny_model, monkeypatch):
    """The default cache (8-bit block keys, 4-bit values, exact sink) through a prefill and decode steps: the
    kernel runs (counted) and the logits match the reference path's."""
    from veloxquant_mlx.integration import make_prompt_cache, use_packed_attention

    ran = []
    real = kernel.decode_step

    def counted(*a, **k):
        out = real(*a, **k)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(kernel, "decode_step", counted)
    prompt = mx.array([[(7 * i) % 128 for i in range(300)]])

    def run():
        cache = make_prompt_cache(tiny_model)
        logits = []
        with use_packed_attention():
            out = tiny_model(prompt, cache=cache)
            tok = mx.argmax(out[:, -1], axis=-1)[:, None]
            for _ in range(6):
                out = tiny_model(tok, cache=cache)
                logits.append(out[:, -1])
                tok = mx.argmax(out[:, -1], axis=-1)[:, None]
        return mx.stack(logits)

    with_kernel = run()
    assert ran and all(ran)
    previous = kernel.set_enabled(False)
    try:
        without = run()
    finally:
        kernel.set_enabled(previous)
    np.testing.assert_allclose(np.array(with_kernel), np.array(without), rtol=1e-4, atol=1e-4)


def test_one_byte_value_scales_read_by_the_kernel_or_decoded_for_a_module_without_the_grid(monkeypatch):
    """kblock_vsym8's uint8 scales reach the kernel as bytes (its own table); a module built before the grid (no
    constants) gets them decoded to float32 first: the same output, both equal to the reference."""
    q, parts = _parts("kblock_vsym8", 4, 256, group_size=128, seed=3)
    coded = [p for p in parts if isinstance(p, CodedPart)][0]
    assert coded.v_codec.affine_codes(coded.v_arrays).scales.dtype == mx.uint8
    ref = reference_one_query(q, parts, 0.125)
    fast = _kernel(q, parts)
    monkeypatch.setattr(kernel, "_reads_log_scales", lambda mod: False)
    decoded = _kernel(q, parts)
    _close(fast, ref)
    _close(decoded, ref)


def test_a_call_the_kernel_refuses_runs_on_the_reference(fresh_kernel_state):
    """TurboQuant-Prod with a QJL sketch shorter than head_dim (jl_dim=40 at d=64): the kernel refuses its layout;
    the step runs on the reference, equal to it, with one warning and the refusal counted."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
    from veloxquant_mlx.integration import use_packed_attention
    mx.random.seed(5)
    k, v, q = mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 4, 1, 64))
    with use_packed_attention():
        cache = TurboQuantPackedCache(method="turboquant_prod", k_bits=4, v_bits=4, jl_dim=40, code_batch=1)
        cache.update_and_fetch(k, v)
        before = kernel.calls()["refused"]
        with pytest.warns(RuntimeWarning, match="refused a call"):
            out = cache.attend_packed(q, 0.125, None)
        assert kernel.calls()["refused"] == before + 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning per kind of refusal, not one per step
            cache.attend_packed(q, 0.125, None)
        expected = reference_one_query(q, cache.attention_parts(), 0.125)
    assert mx.allclose(out, expected, atol=1e-5).item()
