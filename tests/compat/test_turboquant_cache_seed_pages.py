"""The seed pages' standalone-cache code paths, replayed against our classes (issue 15).

The seed's TurboQuantKVCache (shared/seeds) encodes a key with the quantizer, reads ``ev.indices[0]`` as
d code indices and ``ev.signs[0]`` as ±1 values, packs them with ``BitPackBuffer`` into uint8 rows of
ceil(d*b/8) bytes, and later rebuilds an ``EncodedVector`` from the unpacked rows with its own field set to
score queries. These tests run those exact steps and check the scores against the quantizer's own.
"""
import math

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.bit_pack import BitPackBuffer
from veloxquant_mlx.outlier.detector import OutlierDetector
from veloxquant_mlx.quant.quantizers import TurboQuantMSE, TurboQuantProd


def _unit_keys(n, d, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("method,b", [("turboquant_mse", 2), ("turboquant_mse", 3), ("turboquant_prod", 3),
                                      ("turboquant_prod", 1)])
def test_seed_append_and_attend_flow(method, b):
    d, n = 64, 12
    use_prod = method == "turboquant_prod"
    quant = TurboQuantProd(d, b) if use_prod else TurboQuantMSE(d, b)
    b_mse = max(b - 1, 1) if use_prod else b
    m = d
    idx_packer, sign_packer = BitPackBuffer(b_mse), BitPackBuffer(1)
    idx_rows = np.zeros((n, math.ceil(d * b_mse / 8)), dtype=np.uint8)
    sign_rows = np.zeros((n, math.ceil(m / 8)), dtype=np.uint8)
    r_norms = np.zeros((n,), dtype=np.float16)
    keys = _unit_keys(n, d)
    for slot in range(n):  # the seed's append_key, line by line
        ev = quant.encode(mx.array(keys[slot : slot + 1]))
        idx_np = np.array(ev.indices[0], dtype=np.uint8)
        assert idx_np.shape == (d,)
        idx_rows[slot, :] = idx_packer.pack(idx_np)
        if ev.signs is not None:
            sign_np = np.array(ev.signs[0], dtype=np.int8)
            assert set(np.unique(sign_np)) <= {-1, 1}
            sign_rows[slot, :] = sign_packer.pack(np.where(sign_np > 0, np.uint8(1), np.uint8(0)))
            r_norms[slot] = np.float16(float(ev.residual_norm[0]))
    # the seed's attend: non-vectorized unpack, EncodedVector from its own fields
    k_idx = mx.array(np.stack([idx_packer.unpack(idx_rows[i], d) for i in range(n)]), dtype=mx.uint8)
    if use_prod:
        k_signs = np.stack([sign_packer.unpack(sign_rows[i], m).astype(np.int8) * 2 - 1 for i in range(n)])
        ev_seed = EncodedVector(quantizer_type="turboquant_prod", batch_size=n, dim=d, indices=k_idx,
                                signs=mx.array(k_signs, dtype=mx.int8),
                                residual_norm=mx.array(r_norms, dtype=mx.float16))
    else:
        ev_seed = EncodedVector(quantizer_type="turboquant_mse", batch_size=n, dim=d, indices=k_idx)
    q = mx.array(np.random.default_rng(1).standard_normal((d,)).astype(np.float32))
    got = np.array(quant.estimate_inner_product(q, ev_seed))
    want = np.array(quant.estimate_inner_product(q, quant.encode(mx.array(keys))))
    assert got.shape == (n,)
    # unit keys: the seed's missing norms read as 1; stored norms are bfloat16 / float16 rounded
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    if b_mse > 1 or not use_prod:
        np.testing.assert_array_equal(np.array(k_idx), np.array(quant.encode(mx.array(keys)).indices))


def test_encoded_vector_seed_fields_and_packed_views():
    d = 40
    codes = np.random.default_rng(0).integers(0, 8, size=(5, d)).astype(np.uint8)
    ev = EncodedVector(quantizer_type="turboquant_mse", batch_size=5, dim=d, indices=mx.array(codes))
    assert ev.batch_size == 5 and ev.batch_shape == (5,) and ev.norms is None
    np.testing.assert_array_equal(np.array(ev.indices[0]), codes[0])
    signs = np.where(np.random.default_rng(1).random((5, 16)) > 0.5, 1, -1).astype(np.int8)
    ev2 = EncodedVector(quantizer_type="turboquant_prod", batch_size=5, dim=d, indices=mx.array(codes),
                        signs=mx.array(signs), residual_norm=mx.ones((5,), dtype=mx.float16))
    np.testing.assert_array_equal(np.array(ev2.signs), signs)
    # quantizer output: packed storage inside, the seed's views outside
    x = mx.array(np.random.default_rng(2).standard_normal((3, d)).astype(np.float32))
    q = TurboQuantProd(d, 3, m=24)
    ev3 = q.encode(x)
    assert ev3.arrays()["indices"].dtype == mx.uint32 and ev3.arrays()["signs"].shape == (3, 1)
    assert ev3.indices.shape == (3, d) and ev3.signs.shape == (3, 24)
    assert set(np.unique(np.array(ev3.signs)).tolist()) <= {-1, 1}
    # rebuilt from its stored arrays (as the packed caches do) it decodes identically
    again = EncodedVector("turboquant_prod", d, dtype_name=ev3.dtype_name, **ev3.arrays())
    np.testing.assert_array_equal(np.array(q.decode(again)), np.array(q.decode(ev3)))


@pytest.mark.parametrize("kwargs,field", [
    ({"indices": mx.zeros((5, 8), dtype=mx.uint8), "batch_size": 4}, "batch_size"),
    ({"indices": mx.zeros((5, 8)), "batch_size": 5}, "indices"),
    ({"indices": mx.zeros((5, 8), dtype=mx.uint8), "residual_norm": mx.ones((4,))}, "residual_norm"),
    ({"indices": mx.zeros((5, 8), dtype=mx.uint8), "signs": mx.ones((4, 8), dtype=mx.int8)}, "signs"),
    ({}, "indices"),
    ({"indices": [[1, 2]]}, "indices"),
])
def test_encoded_vector_bad_fields_named(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        EncodedVector(quantizer_type="turboquant_mse", dim=8, **kwargs)


def test_encoded_vector_wrong_word_count_named():
    q = TurboQuantMSE(64, 4)
    ev = q.encode(mx.ones((2, 64)))
    bad = EncodedVector("turboquant_mse", 64, indices=ev.arrays()["indices"][:, :3], norms=ev.norms)
    with pytest.raises(ValueError, match="indices"):
        q.decode(bad)


def test_outlier_detector_returns_an_array_the_seed_can_use():
    d = 16
    x = np.random.default_rng(3).standard_normal((32, d)).astype(np.float32)
    x[:, [2, 9]] *= 50
    det = OutlierDetector(n_outliers=2, n_calib=32)
    det.observe(x)
    ch = det.get_outlier_channels()
    assert isinstance(ch, np.ndarray) and np.issubdtype(ch.dtype, np.integer)
    assert ch.tolist() == [2, 9]
    inlier = np.setdiff1d(np.arange(d, dtype=np.int32), ch)  # the seed's line
    assert inlier.tolist() == [j for j in range(d) if j not in (2, 9)]
    assert x[:, ch].shape == (32, 2)
    ch[0] = 7  # a copy: the detector's choice is not changed through it
    assert det.get_outlier_channels().tolist() == [2, 9]


def test_config_accepts_jl_dim_for_mse_without_effect():
    from veloxquant_mlx.cache.turboquant_cache import TurboQuantKVCache

    cfg = KVCacheConfig(method="turboquant_mse", head_dim=32, jl_dim=64)
    assert cfg.jl_dim == 64
    ref = TurboQuantKVCache(KVCacheConfig(method="turboquant_mse", head_dim=32))
    c = TurboQuantKVCache(cfg)
    k = mx.array(np.random.default_rng(4).standard_normal((6, 32)).astype(np.float32))
    q = mx.array(np.random.default_rng(5).standard_normal((32,)).astype(np.float32))
    for cache in (c, ref):
        cache.append_key(k)
        cache.append_value(k)
    np.testing.assert_array_equal(np.array(c.attend(q)), np.array(ref.attend(q)))
    assert c.memory_bytes() == ref.memory_bytes()


def test_prefix_cache_reuse_pattern_of_the_original():
    """The original's prefix-cache reuse: fill a cache with a prompt, turn every state entry into an array,
    rebuild with ``from_state(arrays, cache.meta_state)`` and go on; the rebuilt cache fetches exactly what the
    never-saved cache fetches, and one saved prefix serves several continuations."""
    from veloxquant_mlx.cache.turboquant_rvq_cache import TurboQuantRVQKVCache

    def make():
        return TurboQuantRVQKVCache(KVCacheConfig(method="turboquant_rvq", head_dim=64, bit_width_inlier=2, seed=5))

    def tokens(T, seed):
        rng = np.random.default_rng(seed)
        return tuple(mx.array(rng.standard_normal((1, 2, T, 64)).astype(np.float32)).astype(mx.float16)
                     for _ in range(2))

    prompt = tokens(37, 0)
    cache = make()
    cache.update_and_fetch(*prompt)
    arrays = [mx.array(s) for s in cache.state]  # every entry is an array
    assert len(arrays) == 4
    for seed in (1, 2):  # two requests sharing the prompt
        never_saved = make()
        never_saved.update_and_fetch(*prompt)
        rebuilt = TurboQuantRVQKVCache.from_state(arrays, cache.meta_state)
        assert rebuilt.offset == never_saved.offset == 37
        for T in (1, 1, 5):  # decode steps, then a chunk
            step = tokens(T, seed * 10 + T)
            want, got = never_saved.update_and_fetch(*step), rebuilt.update_and_fetch(*step)
            assert got[0].dtype == want[0].dtype == mx.float16
            assert mx.array_equal(got[0], want[0]) and mx.array_equal(got[1], want[1])
    assert all(mx.array_equal(a, s) for a, s in zip(arrays, cache.state))  # the saved prefix is untouched
