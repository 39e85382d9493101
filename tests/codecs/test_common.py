"""`veloxquant_mlx.codecs.common`: the pieces every codec file shares -- float32 without a cast node, the CPU
crossover rule, the finite channel mean, the float16 clamp, and the fitted-parameter and per-token layout
plumbing (`FittedParams`, `PerTokenLayout`) seen through a minimal codec."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codecs.common import (FLOAT16_MAX, TOKEN_AXIS, PerTokenLayout, clamp_all_to, clamp_to, f32,
                                          finite_channel_mean, packed_matmul_ok)
from veloxquant_mlx.codecs.contract import CodeField


class _Scaled(PerTokenLayout):
    """A minimal layout: a fitted per-head scale, codes ``x / scale`` in float16 plus one int8 field."""

    def __init__(self, d: int):
        self.d = d

    def fitted_spec(self, heads: int):
        return {"scale": ((heads, self.d), mx.float32)}

    def fitted_from(self, x):
        return {"scale": mx.max(mx.abs(f32(x)), axis=(0, 2)) + 1.0}

    def token_fields(self):
        return {"y": ((self.d,), mx.float16), "tag": ((1,), mx.int8)}


def test_f32_adds_no_cast_to_float32_and_casts_the_rest():
    x = mx.array([1.5, -2.0], dtype=mx.float32)
    assert f32(x) is x
    h = x.astype(mx.float16)
    assert f32(h) is not h and f32(h).dtype == mx.float32 and f32(h).tolist() == [1.5, -2.0]


def test_packed_matmul_rule():
    # an explicit threshold decides alone
    assert packed_matmul_ok(8, 8, 1) and not packed_matmul_ok(9, 8, 100)
    # none given: the layout's CPU crossover on CPU, always packed on a GPU
    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert packed_matmul_ok(12, None, 12) and not packed_matmul_ok(13, None, 12)
    finally:
        mx.set_default_device(prev)


def test_finite_channel_mean_skips_non_finite_entries_only_where_they_are():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    clean = np.array(finite_channel_mean(mx.array(x)))
    np.testing.assert_allclose(clean, x.mean(axis=(0, 2)), rtol=1e-6, atol=1e-7)
    poisoned = x.copy()
    poisoned[1, 2, 3, 1] = np.nan
    poisoned[0, 0, 0, 3] = np.inf
    got = np.array(finite_channel_mean(mx.array(poisoned)))
    assert np.all(np.isfinite(got)) and got.shape == (3, 4)
    want = x.mean(axis=(0, 2))
    want[2, 1] = np.delete(x[:, 2, :, 1].reshape(-1), 1 * 5 + 3).mean()  # the 9 finite entries of that channel
    want[0, 3] = np.delete(x[:, 0, :, 3].reshape(-1), 0).mean()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # untouched channels are the plain mean, bit for bit
    assert np.array_equal(got[1], clean[1])


def test_fused_float16_clamp_is_clip_then_cast():
    from veloxquant_mlx.codecs.common import clamp_all_to, clamp_to

    x = mx.array([1e6, -1e6, 65504.0, -3.25, 0.0, 1e-9, float("nan")])
    want = mx.clip(x, -65504.0, 65504.0).astype(mx.float16)
    a, b = clamp_all_to(mx.float16, x, 2 * x.reshape(7, 1))
    assert bool(mx.array_equal(a, want, equal_nan=True)) and a.dtype == mx.float16
    assert b.shape == (7, 1) and bool(mx.array_equal(b.reshape(-1), mx.clip(2 * x, -65504.0, 65504.0).astype(mx.float16),
                                                     equal_nan=True))
    assert bool(mx.array_equal(clamp_to(x, mx.float16), want, equal_nan=True))
    assert clamp_to(x, mx.bfloat16).dtype == mx.bfloat16 and float(clamp_to(x, mx.float32)[0]) == 1e6


def test_clamp_keeps_infinities_visible():
    x = mx.array([float("inf"), float("-inf"), 7e4, -7e4])
    got = clamp_to(x, mx.float16).astype(mx.float32).tolist()
    assert got == [float("inf"), float("-inf"), FLOAT16_MAX, -FLOAT16_MAX]
    a, b = clamp_all_to(mx.float32, x, x)
    assert a.dtype == b.dtype == mx.float32 and a.tolist() == x.tolist()


def test_fitted_params_plumbing():
    c = _Scaled(4)
    assert not c.fitted and c.fitted_arrays() == {} and c.fitted_param("scale") is None
    x = mx.array(np.random.default_rng(1).standard_normal((1, 2, 6, 4)).astype(np.float32))
    arrays = c.fitted_from(x)
    twin = c.with_fitted(arrays)
    assert twin.fitted and not c.fitted  # a copy holds them, the original stays unfitted
    assert mx.array_equal(twin.fitted_param("scale"), arrays["scale"])
    blank = c.blank_fitted(3)
    assert list(blank) == ["scale"] and blank["scale"].shape == (3, 4) and blank["scale"].dtype == mx.float32
    c.fit(x)
    assert c.fitted and mx.array_equal(c.fitted_arrays()["scale"], arrays["scale"])
    assert c.check_fitted({}) == {}  # unfitted always passes
    with pytest.raises(ValueError, match=r"missing \['scale'\], unexpected \['bias'\]"):
        c.check_fitted({"bias": arrays["scale"]})
    with pytest.raises(ValueError, match=r"'scale' has shape \(2, 3\).*expected \(H, 4\) mlx.core.float32 per head"):
        c.load_fitted({"scale": arrays["scale"][:, :3]})
    with pytest.raises(ValueError, match=r"'scale'.*float16"):
        c.load_fitted({"scale": arrays["scale"].astype(mx.float16)})
    with pytest.raises(ValueError, match=r"'scale' must be an mx.array"):
        c.load_fitted({"scale": np.zeros((2, 4), np.float32)})


def test_per_token_layout_bookkeeping_and_checks():
    c = _Scaled(4)
    layout = c.code_layout(3)
    assert layout == {"y": CodeField(TOKEN_AXIS, 1, (1, 3, 1, 4), mx.float16),
                      "tag": CodeField(TOKEN_AXIS, 1, (1, 3, 1, 1), mx.int8)}
    assert layout["y"].shape(5, rows=2) == (2, 3, 5, 4)
    codes = {"y": mx.arange(2 * 3 * 5 * 4).reshape(2, 3, 5, 4).astype(mx.float16),
             "tag": mx.zeros((2, 3, 5, 1), dtype=mx.int8)}
    assert c.n_tokens(codes) == 5 and c.n_tokens({}) == 0
    head, tail = c.slice_tokens(codes, 0, 2), c.slice_tokens(codes, 2, 5)
    assert c.n_tokens(head) == 2 and c.n_tokens(tail) == 3
    joined = c.concat([head, {}, tail])
    assert all(mx.array_equal(joined[f], codes[f]) for f in codes)
    c.check_codes(codes, "restored")
    with pytest.raises(ValueError, match=r"restored: stored code arrays \['y'\].*missing \['tag'\]"):
        c.check_codes({"y": codes["y"]}, "restored")
    with pytest.raises(ValueError, match=r"restored: code arrays disagree on \(B, H, tokens\)"):
        c.check_codes({"y": codes["y"], "tag": codes["tag"][:, :, :4]}, "restored")
    with pytest.raises(ValueError, match=r"restored: array 'y' has shape \(2, 3, 5, 4\) mlx.core.float32, "
                                         r"expected \(B, H, n, 4\) mlx.core.float16"):
        c.check_codes({"y": codes["y"].astype(mx.float32), "tag": codes["tag"]}, "restored")
    with pytest.raises(NotImplementedError, match="must declare token_fields"):
        PerTokenLayout().token_fields()
