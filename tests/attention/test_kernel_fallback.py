"""The compiled attention on codes, continued: the fallback (kernel off, missing, built against another MLX or from
other sources, failing its first-use checks) runs the reference with one warning; what the kernel keeps between steps
follows the cache; a model decodes the same logits with and without the kernel.
"""
from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.attention import kernel
from veloxquant_mlx.attention.packed_sdpa import CodedPart, attend_one_query, reference_one_query
from _kernel_helpers import (
    _parts,
    _close,
    _kernel,
    fresh_kernel_state,
    _falls_back_with_one_warning,
    _load_fake,
    _fresh,
)


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


def test_missing_or_mismatched_module_falls_back_with_one_warning(fresh_kernel_state, monkeypatch):
    import sys
    import types

    fake = types.ModuleType("veloxquant_mlx.attention._coded_attention")
    fake.built_with_mlx = "0.0.1"
    monkeypatch.setitem(sys.modules, "veloxquant_mlx.attention._coded_attention", fake)
    _falls_back_with_one_warning(monkeypatch, "built against MLX 0.0.1")
    assert kernel.status()[0] is False and "rebuild" in kernel.status()[1]
    assert "python -m veloxquant_mlx.attention.build_kernel" in kernel.status()[1]  # (the command, named)


def test_a_module_built_from_other_sources_is_refused(fresh_kernel_state, monkeypatch):
    """A kernel built before the sources changed (a checkout updated since) is not used: it would be called with
    arguments it does not know. The module built here carries the digest of these very sources."""
    from veloxquant_mlx.attention._sources import source_hash
    assert kernel.compiled_module().built_from_sources == source_hash()
    real = kernel.compiled_module()
    reason = _load_fake(monkeypatch, coded_decode_attention=real.coded_decode_attention, built_from_sources="0" * 16)
    assert "other sources" in reason and "rebuild" in reason


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


@pytest.mark.parametrize("name", ["tq-affine-k8v4", "tq-prod-k4v4", "tq-3b"])
def test_what_the_kernel_keeps_between_steps_follows_the_cache(name):
    """Decode steps reuse the coded part and the kernel's view of it until the cache codes its next tokens: through
    blocks coded, trims into the codes (slots written again), and a batch of two rows coding at different steps,
    every step equals the reference on freshly built parts."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache, TurboQuantPackedCache
    from veloxquant_mlx.cache._batch import _folded_part_masks
    from veloxquant_mlx.integration.routing import use_packed_attention

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
    from veloxquant_mlx.integration.builder import make_prompt_cache
    from veloxquant_mlx.integration.routing import use_packed_attention

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
    from veloxquant_mlx.integration.routing import use_packed_attention
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
