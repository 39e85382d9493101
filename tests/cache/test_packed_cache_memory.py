"""A cache holds the memory its ``nbytes`` says, nothing hidden.

MLX frees a buffer when no array refers to it, and a slice is a view: a cache that keeps a view of the caller's
arrays (a 4-token sink cut from a 4096-token prompt) or an unevaluated expression over its own old buffers keeps
far more alive than it reports. `mx.get_active_memory()` sees it; these tests compare the two.
"""
from __future__ import annotations

import gc

import mlx.core as mx
import pytest

import veloxquant_mlx as vq
from veloxquant_mlx.apps.eval.memory import _stub_model, cache_nbytes
from veloxquant_mlx.quant.rotation import make_rotation

H, D = 3, 64
# Arrays outside the caches (placeholders, small constants) may come and go by a few KiB.
SLACK = 16 * 1024


def _active():
    gc.collect()
    return mx.get_active_memory()


def _held_by(build):
    """(bytes that deleting the caches frees, their reported nbytes): what the caches alone keep alive, whatever
    else the process allocated meanwhile (compiled kernels, constants). MLX's buffer cache is emptied first: a
    buffer reused from it may be larger than asked for, which active memory counts."""
    mx.clear_cache()
    caches = build()
    reported = sum(cache_nbytes(c) for c in caches)
    with_caches = _active()
    del caches
    return with_caches - _active(), reported


def _fill(caches, prompt: int, steps: int, seed: int = 0):
    # One long prompt (sinks are cut from it), then single-token steps across several block boundaries.
    kv = mx.random.normal((1, H, prompt + steps, D), key=mx.random.key(seed))
    mx.eval(kv)
    for c in caches:
        c.update_and_fetch(kv[:, :, :prompt], kv[:, :, :prompt])
        for t in range(prompt, prompt + steps):
            k = kv[:, :, t : t + 1]
            c.update_and_fetch(k, k)
        mx.eval([a for a in _arrays(c)])
    return caches


def _arrays(cache):
    return cache.rows.arrays()


@pytest.mark.parametrize("config", ["tq-affine-k4v4", "tq-affine-k8v4", "tq-mse-k4v4"])
@pytest.mark.parametrize("steps", [0, 64, 70])
def test_cache_keeps_no_hidden_memory(config, steps):
    """After a 4096-token prompt and steps that code whole blocks (the tail empties at 64), the memory still in
    use is the cache's nbytes: no view of the prompt, no old buffer kept by a lazy expression."""
    from veloxquant_mlx.apps.eval.specs import resolve_spec

    spec = resolve_spec(config, None, D)
    for _ in range(2):  # process-wide constants (the shared rotations, compiled kernels) exist now
        _fill(spec.make_cache(_stub_model(1, H, D)), 200, 70)
    held, reported = _held_by(lambda: _fill(spec.make_cache(_stub_model(2, H, D)), 4096 - 60, steps))
    assert reported > 0
    assert held <= reported + SLACK, f"{config}: deleting the caches freed {held} bytes, {reported} reported"


def test_layers_share_one_rotation():
    """Every layer of a cache uses the same seeds: one rotation matrix in memory, not one per layer."""
    caches = _fill(vq.make_prompt_cache(_stub_model(4, H, D), codec="affine", k_bits=4, v_bits=4), 8, 0)
    mats = {id(c.k_codec.rotation) for c in caches} | {id(c.v_codec.rotation) for c in caches}
    assert len(mats) == 2  # keys and values have independent rotations, shared by the layers
    assert make_rotation(D, 5) is make_rotation(D, 5)
    assert make_rotation(D, 5) is not make_rotation(D, 6)
    with pytest.raises(ValueError, match="seed"):
        make_rotation(D, -1)
    with pytest.raises(ValueError, match="rotation kind"):
        make_rotation(D, 0, "qr")


def _span(a: mx.array):
    """(first byte address, bytes) of ``a``'s data (a view's address lies inside the buffer it views)."""
    import numpy as np

    x = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a  # (numpy reads no bfloat16: the same bytes)
    mx.eval(x)
    return np.asarray(x).__array_interface__["data"][0], a.nbytes


@pytest.mark.parametrize("config", ["tq-affine-k8v4", "tq-mse-k4v4"])
def test_a_row_extracted_from_a_batch_holds_only_its_own_memory(config):
    """mlx_lm's `extract` hands a finished request's row to the prompt cache while the batch goes on: the row must
    be a copy of its own slots, never a view keeping the whole batch's buffers alive after the batch is gone."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache
    from veloxquant_mlx.apps.eval.specs import CONFIGURATIONS

    lengths = [700, 90, 1500]
    T = max(lengths)

    def extracted(keep_batch=None):
        kv = mx.random.normal((3, H, T, D), key=mx.random.key(len(lengths)))
        batch = TurboQuantBatchPackedCache(CONFIGURATIONS[config], 3)
        with vq.use_packed_attention():
            batch.prepare(lengths=lengths, right_padding=[T - n for n in lengths])
            batch.update_and_fetch(kv, kv)
            batch.finalize()
            for t in range(70):  # rows code their blocks on different steps
                k = mx.random.normal((3, H, 1, D), key=mx.random.key(t))
                batch.update_and_fetch(k, k)
        out = batch.extract(1)
        mx.eval(_arrays(out))
        if keep_batch is not None:
            keep_batch.append(batch)
        return [out]

    # no array of the row lies in the batch's memory ...
    kept = []
    row = extracted(kept)[0]
    batch_spans = [_span(a) for a in kept[0].rows.arrays()]
    for a in _arrays(row):
        lo, n = _span(a)
        assert not any(b <= lo < b + m or lo <= b < lo + n for b, m in batch_spans), (config, a.shape, a.dtype)
    del kept, row
    # ... and deleting the row frees what it reports (small arrays round up in the allocator: a few KiB each; a
    # view of the batch would hold its 1-2 MB)
    for _ in range(2):
        extracted()
    held, reported = _held_by(extracted)
    assert reported > 0
    assert held <= reported + 4 * SLACK, f"{config}: deleting the extracted row freed {held} bytes, {reported} reported"
