"""The codec contract, continued: the declared contract of every registered layout over several bit widths and
options (`check_layout`, `check_blank_fitted`, `check_pure_fitting`), and a codec written as one file outside the
package and registered with one line. (The Lloyd-Max level planes moved to `test_lloyd_max.py` / `test_levels.py`,
the fused dequantization to `test_dequant.py`, the float16 clamp to `test_common_codec.py`.)
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codecs.contract import Codec
from _codec_contract_helpers import (
    H,
    CASES,
    make,
    data,
    fitted,
    rel,
    CONTRACT_CASES,
    check_layout,
    check_blank_fitted,
    check_pure_fitting,
    absmax8,
    _exact_attention,
)


@pytest.mark.parametrize("name,role,variant", CONTRACT_CASES)
def test_code_layout_is_what_encode_returns(name, role, variant):
    check_layout(make(name, role, **variant))


@pytest.mark.parametrize("name,role,variant", CONTRACT_CASES)
def test_blank_fitted_matches_a_real_fit(name, role, variant):
    check_blank_fitted(lambda: make(name, role, **variant))


@pytest.mark.parametrize("name,role,variant", CONTRACT_CASES)
def test_fitting_without_mutation_equals_fit(name, role, variant):
    check_pure_fitting(lambda: make(name, role, **variant))


def test_every_fitted_array_is_per_head():
    """What batching rows needs: axis 0 of every fitted array is the heads (batch rows concatenate along it)."""
    for name, role in CASES:
        c = make(name, role)
        for heads in (1, 4):
            x = data(2 * max(c.token_block, 32))[:1, :1] * mx.ones((1, heads, 1, 1))
            assert all(a.shape[0] == heads for a in c.fitted_from(x).values()), (name, role)


def test_a_new_codec_is_one_file_and_one_registry_line(absmax8):
    for role in ("keys", "values"):
        c = make("absmax8", role, bits=8)
        assert type(c) is absmax8 and isinstance(c, Codec)
        check_layout(c)
        check_blank_fitted(lambda: make("absmax8", role, bits=8))
        check_pure_fitting(lambda: make("absmax8", role, bits=8))
        c, x, codes = fitted("absmax8", role, bits=8)
        y = c.decode(codes, mx.float32)
        assert float(mx.linalg.norm(y - x) / mx.linalg.norm(x)) < 0.01
        c.check_codes(codes, "restored")
        with pytest.raises(ValueError, match="restored"):
            c.check_codes({"q": codes["q"]}, "restored")
        rng = np.random.default_rng(1)
        for rows in (1, 64):
            q = mx.array(rng.standard_normal((2, H, rows, 64)).astype(np.float32))
            p = mx.softmax(mx.array(rng.standard_normal((2, H, rows, x.shape[2])).astype(np.float32)), axis=-1)
            assert rel(c.scores(q, codes), q @ mx.swapaxes(y, -1, -2)) < 1e-5
            assert rel(c.weighted_sum(p, codes), p @ y) < 1e-5


def test_a_new_codec_runs_in_a_real_cache(absmax8):
    """The registered name builds a cache whose attention on the codes is softmax attention on its history."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache

    cache = TurboQuantPackedCache(codec="absmax8", k_bits=8)
    rng = np.random.default_rng(3)
    rand = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    seen = {"k": [], "v": []}
    for T in (70, 1, 1):  # a prompt, then two decode steps
        keys, values = rand(2, H, T, 64), rand(2, H, T, 64)
        seen["k"].append(keys)
        seen["v"].append(values)
        hist = cache.update_and_fetch(keys, values)
        assert hist[0].shape[2] == cache.offset == sum(a.shape[2] for a in seen["k"])
        for heads in (H, 2 * H):  # one query head per KV head, and grouped (GQA)
            q = rand(2, heads, 1, 64)
            assert rel(cache.attend_packed(q, 0.125, None), _exact_attention(q, hist[0], hist[1], 0.125)) < 1e-4
    assert type(cache.k_codec) is absmax8 and type(cache.v_codec) is absmax8
    assert cache.k_codec.fitted and sorted(cache.k_codec.fitted_arrays()) == ["mean"]
    # The history really went through the codes: coded tokens decode with 8-bit absmax error (~0.5 %), not exactly.
    n = cache.n_coded
    exact = mx.concatenate(seen["k"], axis=2)[:, :, :n]
    assert n > 0 and 0 < rel(hist[0][:, :, :n], exact) < 0.02
