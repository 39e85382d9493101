"""The ``keys`` attribute mlx_lm's pipeline-parallel models write on a cache (veloxquant_mlx.cache._pipeline): held as
a dependency, the next update made to wait for it, then cleared; the values themselves unchanged."""
from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache._pipeline import PipelineDependency
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache


class _Holder(PipelineDependency):
    pass


def test_keys_hold_the_dependency_until_an_update_takes_it():
    h = _Holder()
    assert h.keys.shape == () and h.keys.item() == 0.0  # nothing pending: a scalar stand-in
    k, v = mx.arange(6.0).reshape(1, 1, 3, 2), -mx.arange(6.0).reshape(1, 1, 3, 2)
    assert all(a is b for a, b in zip(h._after_dependency(k, v), (k, v)))  # nothing to wait for: the same arrays
    dep = mx.array([7.0])
    h.keys = mx.depends(h.keys, dep)  # what mlx_lm's pipeline does at the end of a rank's forward pass
    assert h._dependency is not None and h.keys is h._dependency
    k2, v2 = h._after_dependency(k, v)
    assert k2 is not k and mx.array_equal(k2, k).item() and mx.array_equal(v2, v).item()
    assert h._dependency is None and h.keys.item() == 0.0  # taken once


def test_a_packed_cache_stores_the_same_tokens_after_a_pipeline_write():
    k = mx.random.normal((1, 2, 20, 32), key=mx.random.key(0))
    v = mx.random.normal((1, 2, 20, 32), key=mx.random.key(1))
    options = dict(codec="affine", k_bits=4, v_bits=4, sink=2)
    written, plain = TurboQuantPackedCache(**options), TurboQuantPackedCache(**options)
    for c in (written, plain):
        c.update_and_fetch(k[:, :, :12], v[:, :, :12])
    written.keys = mx.depends(written.keys, mx.ones((3,)))
    assert written._dependency is not None
    got, want = written.update_and_fetch(k[:, :, 12:], v[:, :, 12:]), plain.update_and_fetch(k[:, :, 12:], v[:, :, 12:])
    assert written._dependency is None
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
