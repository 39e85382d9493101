"""What every packed cache face shares (veloxquant_mlx.cache._face): `attend_packed` on a real cache's codes against
SDPA on what it fetches, the checks of updates and windows, static channel weights, copies."""
from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from veloxquant_mlx.cache import _face
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from _packed_attention_helpers import D, assert_close, banded_sdpa_reference, rand


# -- attend_packed: attention on a real packed cache's buffers equals attention on what it fetches ----------------
def test_attend_packed_matches_fetch():
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
    from veloxquant_mlx.compat.config import KVCacheConfig

    cache = TurboQuantPackedCache(KVCacheConfig(bit_width_inlier=3, n_outlier_channels=4), sink=2, recent=3)
    hist = None
    for step, T in enumerate([7, 1, 1, 4, 12, 1]):
        k, v = rand((1, 2, T, D), 10 + step, 0.5), rand((1, 2, T, D), 20 + step)
        hist = cache.update_and_fetch(k, v)
        q = rand((1, 6, T, D), 30 + step)
        mask = "causal" if T > 1 else None
        out = cache.attend_packed(q, 0.125, mask)
        ref = banded_sdpa_reference(cache, q, hist[0], hist[1], 0.125, mask)  # (a chunk reads its newest exact)
        assert_close(out, ref)
    kinds = [type(p).__name__ for p in cache.attention_parts()]
    # sink, codes, (tail tokens the cache reads as coded, if any), exact recent window
    assert cache.n_coded > 0
    assert kinds[:2] == ["ExactPart", "CodedPart"] and kinds[-1] == "ExactPart"


def test_attend_packed_of_rotating_cache_matches_fetch():
    from veloxquant_mlx.cache.packed_cache import TurboQuantRotatingPackedCache
    from veloxquant_mlx.compat.config import KVCacheConfig

    cache = TurboQuantRotatingPackedCache(KVCacheConfig(bit_width_inlier=4), max_size=32, keep=2, sink=2, recent=3)
    for step, T in enumerate([20, 1, 16, 1, 1, 5, 1]):
        k, v = rand((1, 2, T, D), 40 + step, 0.5), rand((1, 2, T, D), 50 + step)
        mask = cache.make_mask(T, window_size=24)  # mlx_lm builds the mask before the update
        hist = cache.update_and_fetch(k, v)
        q = rand((1, 4, T, D), 60 + step)
        out = cache.attend_packed(q, 0.125, mask)
        ref_mask = create_causal_mask(T, hist[0].shape[2] - T) if isinstance(mask, str) else mask
        ref = banded_sdpa_reference(cache, q, hist[0], hist[1], 0.125, ref_mask)
        assert_close(out, ref)
    assert cache.n_coded > 0


# -- checks ------------------------------------------------------------------------------------------------------
def test_check_window_returns_the_window_or_names_what_is_wrong():
    affine = CacheOptions(codec="affine", k_bits=4, sink=2)
    assert _face._check_window(affine, 32, 4) == (32, 4)
    with pytest.raises(ValueError, match="codec='affine_block' codes keys in blocks"):
        _face._check_window(CacheOptions(codec="affine_block", k_bits=8), 32, 4)
    with pytest.raises(ValueError, match=r"keep must be <= max_size \(8\), got 9"):
        _face._check_window(affine, 8, 9)
    with pytest.raises(ValueError, match=r"sink must be <= keep \(1\) .* got 2"):
        _face._check_window(affine, 32, 1)
    with pytest.raises(TypeError, match="max_size"):
        _face._check_window(affine, 2.5, 1)
    with pytest.raises(ValueError, match="keep"):
        _face._check_window(affine, 32, -1)


def test_check_pair_names_the_disagreement():
    k = mx.zeros((1, 2, 3, 8))
    _face._check_pair(k, mx.zeros((1, 2, 3, 4)), 8, 4)  # (key and value dims may differ)
    with pytest.raises(ValueError, match=r"agree on \(B, H, T\): keys \(1, 2, 3, 8\), values \(1, 2, 4, 8\)"):
        _face._check_pair(k, mx.zeros((1, 2, 4, 8)), None, None)
    with pytest.raises(ValueError, match="at least one token"):
        _face._check_pair(k[:, :, :0], k[:, :, :0], None, None)
    with pytest.raises(ValueError, match="head_dim"):
        _face._check_pair(k, k, 16, None)


# -- static channel weights ----------------------------------------------------------------------------------------
def _weights(seed, heads=2, d=16):
    rng = np.random.default_rng(seed)
    return tuple(tuple(int(e) for e in rng.integers(-3, 4, d)) for _ in range(heads))


def test_weight_arrays_are_powers_of_two_shared_per_layer():
    log2 = (_weights(0), _weights(1))
    wk, wv = _face._weight_arrays(log2)
    assert wk.dtype == mx.float32 and wk.shape == (2, 16)
    assert np.array_equal(np.array(wk), 2.0 ** np.array(log2[0]))
    assert np.array_equal(np.array(wv), 2.0 ** np.array(log2[1]))
    assert _face._weight_arrays(log2)[0] is wk  # (one copy for every cache of the layer)
    assert _face._weight_arrays(None) is None


def test_channel_weights_change_what_is_stored_not_what_attention_gives():
    """Stored = x * 2**log2 (exact in floating point); queries divided by the key weights and the output by the value
    weights: attention equals that of the same cache without weights, and the fetched history is the tokens given."""
    log2 = (_weights(2), _weights(3))
    weighted = TurboQuantPackedCache(codec="float16", k_bits=16, sink=1, calibration_id="t", channel_log2=log2)
    plain = TurboQuantPackedCache(codec="float16", k_bits=16, sink=1)
    k, v = rand((1, 2, 30, 16), 0), rand((1, 2, 30, 16), 1)
    for c in (weighted, plain):
        c.update_and_fetch(k, v)
    wk, wv = weighted.channel_weights
    sink = weighted.attention_parts()[0]  # the exact first token, as stored
    assert np.array_equal(np.array(sink.keys), np.array(k[:, :, :1] * wk[:, None, :]))
    assert np.array_equal(np.array(sink.values), np.array(v[:, :, :1] * wv[:, None, :]))
    for a, b in zip(weighted._fetch(mx.float32), plain._fetch(mx.float32)):
        assert mx.array_equal(a, b).item()
    q = rand((1, 4, 1, 16), 4)
    out, ref = weighted.attend_packed(q, 0.25, None), plain.attend_packed(q, 0.25, None)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-6, atol=1e-7)
    assert plain.channel_weights is None
    fresh = TurboQuantPackedCache(codec="float16", k_bits=16, calibration_id="t", channel_log2=log2)
    with pytest.raises(ValueError, match="channel weights .* are for 2 KV heads of dims 16/16"):
        fresh.update_and_fetch(rand((1, 3, 1, 16), 5), rand((1, 3, 1, 16), 6))


# -- copies and properties -----------------------------------------------------------------------------------------
def test_a_deep_copy_goes_on_alone():
    cache = TurboQuantPackedCache(codec="affine", k_bits=4, v_bits=2, sink=2)
    cache.update_and_fetch(rand((1, 2, 40, D), 7), rand((1, 2, 40, D), 8))
    twin = copy.deepcopy(cache)
    assert twin.rows is not cache.rows and twin.options is cache.options
    before = [np.array(a) for a in cache._fetch(mx.float32)]
    twin.update_and_fetch(rand((1, 2, 5, D), 9), rand((1, 2, 5, D), 10))
    assert (twin.offset, cache.offset) == (45, 40)
    for a, b in zip(before, cache._fetch(mx.float32)):
        assert np.array_equal(a, np.array(b))  # the original's history is untouched
    assert (cache.k_bits, cache.v_bits, cache.sink, cache.codec) == (4, 2, 2, "affine")
    assert cache.config.bit_width_inlier == 4 and cache.config.v_bits == 2
    assert cache.nbytes == cache.rows.nbytes > 0
