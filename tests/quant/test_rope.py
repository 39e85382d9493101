"""`veloxquant_mlx.quant.rope`: RoPE read off a module as a per-pair rotation, the key offset's math."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import rope_utils

from veloxquant_mlx.quant.rope import OFFSET_BLOCK, RopeFrame, fit_mean, frame_of, offset_keys, offset_scores, rotate


@pytest.mark.parametrize("rope, d", [
    (nn.RoPE(64, traditional=False, base=10000), 64),
    (nn.RoPE(64, traditional=True, base=500000), 64),
    (nn.RoPE(32, traditional=False, base=10000), 64),  # partial rotary: the last 32 channels stay
    (nn.RoPE(128, scale=0.25, base=1000000), 128),  # linear scaling
    (rope_utils.initialize_rope(64, 500000.0, False, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192}, 131072), 64),
])
def test_a_module_read_as_a_frame_rotates_as_the_module_does(rope, d):
    frame, why = frame_of(rope, d)
    assert frame is not None, why
    x = mx.random.normal((2, 3, 5, d), key=mx.random.key(1))
    for t in (0, 17, 4093, 30000):
        want = rope(x, offset=t)
        got = rotate(x, mx.arange(t, t + 5), frame)
        assert mx.allclose(got, want, atol=2e-3 * (1 + t / 10000), rtol=1e-4).item(), t
    # R_{-t} undoes R_t
    back = rotate(rotate(x, mx.arange(5) + 999, frame), -(mx.arange(5) + 999), frame)
    assert mx.allclose(back, x, atol=1e-4).item()
    assert RopeFrame.from_list(frame.to_list()) == frame


def test_a_rope_that_scales_its_input_is_not_read():
    yarn = rope_utils.initialize_rope(64, 10000.0, False, {"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 4096}, 16384)
    frame, why = frame_of(yarn, 64)
    assert frame is None and "not a per-pair rotation" in why
    frame, why = frame_of(lambda x, offset=0: x * 2, 64)
    assert frame is None and why


def test_offset_scores_per_block_equal_the_direct_product():
    frame = frame_of(nn.RoPE(64, base=10000), 64)[0]
    mu = mx.random.normal((3, 64), key=mx.random.key(2))
    q = mx.random.normal((3, 5, 64), key=mx.random.key(3))
    for n in (1, 7, OFFSET_BLOCK, OFFSET_BLOCK * 3 + 5):
        starts = mx.array([0, 129, 5000], dtype=mx.int32)
        direct = q @ mx.swapaxes(offset_keys(mu, starts, n, frame), -1, -2)
        got = offset_scores(q, mu, starts, n, frame)
        assert got.shape == (3, 5, n)
        assert mx.allclose(got, direct, atol=2e-3, rtol=1e-4).item(), n


def test_fit_mean_recovers_the_mean_before_rope():
    frame = frame_of(nn.RoPE(64, base=10000), 64)[0]
    mu = mx.random.normal((2, 64), key=mx.random.key(4))
    noise = mx.random.normal((1, 2, 400, 64), key=mx.random.key(5)) * 0.1
    start = 37
    keys = rotate(mu[None, :, None, :] + noise, (mx.arange(400) + start)[None, None], frame)
    keys[0, 1, 3] = mx.nan  # a non-finite token is left out
    got = fit_mean(keys, start, frame)
    assert mx.allclose(got, mu, atol=0.03).item()


@pytest.mark.parametrize("bad", [dict(dims=3), dict(dims=64, rates=(0.1,)), dict(dims=4, rates=(0.1, float("nan")))])
def test_bad_frames_are_refused(bad):
    with pytest.raises(ValueError, match="RopeFrame"):
        RopeFrame(**{"dims": 4, "traditional": False, "rates": (0.1, 0.2), **bad})
    with pytest.raises(TypeError, match="traditional"):
        RopeFrame(4, "no", (0.1, 0.2))
