"""Bad keys, values and codes given to the caches and quantizers (issue part 5): non-finite values kept to their
own token or refused naming the argument, empty batches or heads refused naming the keys, bad codes given to a
quantizer's decode refused by name.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from veloxquant_mlx.codecs import CODECS
from veloxquant_mlx.apps.eval.specs import CONFIGURATIONS
from _bad_input_helpers import (
    NF_D,
    NF_BAD,
    NF_T,
    _nf_options,
    _nf_data,
    _poison,
    _blocked,
    _assert_only_token_bad,
    _nf_attention,
    _zero_test_caches,
    ZERO_SHAPES,
    ZERO_MESSAGE,
    ZERO_CASES,
    QUANT,
    QUANT_CASES,
)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("side", ["keys", "values"])
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_one_non_finite_coordinate_stays_in_its_token_or_is_refused(codec, side, bad):
    opts = _nf_options(codec)
    k, v = _nf_data(NF_T)
    kb, vb = (_poison(k, bad), v) if side == "keys" else (k, _poison(v, bad))
    clean, cache = TurboQuantPackedCache(opts), TurboQuantPackedCache(opts)
    clean_hist = clean.update_and_fetch(k, v)
    hist = cache.update_and_fetch(kb, vb)
    i = 0 if side == "keys" else 1
    _assert_only_token_bad(hist[i], clean_hist[i], bad)
    assert bool(mx.array_equal(hist[1 - i], clean_hist[1 - i]))  # the other argument is untouched
    _nf_attention(cache, *hist, side)

    # The next tokens make the cache code token 10: a per-token layout keeps it to itself, a block layout refuses.
    k2, v2 = _nf_data(64, seed=1)
    clean_more = clean.update_and_fetch(k2, v2)
    if _blocked(codec, side):
        with pytest.raises(ValueError, match=rf"^{side}\b.*token {NF_BAD}\b.*{codec}") as e:
            cache.update_and_fetch(k2, v2)
        assert "non-finite" in str(e.value)
        assert cache.offset == NF_T and cache.n_coded == 0  # unchanged: the same history as before
        assert all(bool(mx.array_equal(a, b, equal_nan=True)) for a, b in zip(cache._fetch(mx.float32), hist))
    else:
        more = cache.update_and_fetch(k2, v2)
        assert cache.rows.sink_n[0] + cache.n_coded > NF_BAD  # token 10 is coded now
        _assert_only_token_bad(more[i], clean_more[i], bad)
        _nf_attention(cache, *more, side)


@pytest.mark.parametrize("codec", ["affine_block", "affine_block_kv"])
def test_block_layout_refuses_a_non_finite_key_in_the_update_that_codes_it(codec):
    """Coded at once (no trim headroom): the first update itself is refused and stores nothing."""
    cache = TurboQuantPackedCache(_nf_options(codec, trim_headroom=0))
    k, v = _nf_data(NF_T)
    with pytest.raises(ValueError, match=r"^keys\b.*token 10\b"):
        cache.update_and_fetch(_poison(k, float("inf")), v)
    assert cache.empty() and cache.n_coded == 0 and cache.dims is None
    cache.update_and_fetch(k, v)  # the same cache takes finite keys afterwards
    assert cache.n_coded == 64


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("name,role", sorted({(n, r) for n in CODECS for r in ("keys", "values")}))
def test_codec_never_hides_a_non_finite_token(name, role, bad):
    """Under the caches' refusal, each codec's own contract: a per-token layout keeps a non-finite token to itself;
    a block layout cannot, and decodes its block NaN (never a finite value in place of the bad one)."""
    layout = CODECS[name]
    cls = getattr(layout, role)
    codec = cls.from_options(_nf_options(name), role, NF_D)
    x = _poison(_nf_data(128)[0], bad)
    codec.fit(x)
    y = np.array(codec.decode(codec.encode(x), mx.float32))
    bad_rows = ~np.isfinite(y).all(axis=-1)
    want = np.zeros(bad_rows.shape, bool)
    if cls.BLOCKED:
        start = NF_BAD // codec.token_block * codec.token_block
        want[0, 0, start: start + codec.token_block] = True
    else:
        want[0, 0, NF_BAD] = True
    assert (bad_rows == want).all(), np.nonzero(bad_rows)
    if np.isnan(bad) or cls.BLOCKED:
        assert np.isnan(y[0, 0, NF_BAD]).any()


@pytest.mark.parametrize("name,shape,after", ZERO_CASES,
                         ids=[f"{n}-{s}-{'after-an-update' if a else 'fresh'}" for n, s, a in ZERO_CASES])
def test_empty_batch_or_heads_refused_naming_keys(name, shape, after):
    from veloxquant_mlx import use_packed_attention

    shape = ZERO_SHAPES[shape]
    cache = _zero_test_caches()[name]()
    with use_packed_attention():  # (batch caches attend only from their codes)
        if after:
            cache.update_and_fetch(*(mx.zeros((2, 2, 70, NF_D)) for _ in range(2)))
        offset = np.array(cache.offset).tolist()
        x = mx.zeros(shape)
        with pytest.raises(ValueError, match=ZERO_MESSAGE) as e:
            cache.update_and_fetch(x, x)
    assert str(tuple(shape)) in str(e.value)
    assert np.array(cache.offset).tolist() == offset


def test_batch_filtered_to_no_sequences_refuses_a_decode_step():
    from veloxquant_mlx import use_packed_attention

    caches = [TurboQuantPackedCache(CONFIGURATIONS["tq-affine-k8v4"]) for _ in range(2)]
    for c in caches:
        c.update_and_fetch(*_nf_data(5))
    batch = TurboQuantPackedCache.merge(caches)
    with use_packed_attention():
        batch.update_and_fetch(*(mx.zeros((2, 2, 1, NF_D)) for _ in range(2)))
        batch.filter([])
        x = mx.zeros((0, 2, 1, NF_D))
        with pytest.raises(ValueError, match=ZERO_MESSAGE):
            batch.update_and_fetch(x, x)


@pytest.mark.parametrize("name,label,build,err,words", QUANT_CASES, ids=[f"{c[0]}-{c[1]}" for c in QUANT_CASES])
def test_quantizer_decode_refuses_bad_codes_by_name(name, label, build, err, words):
    q = mx.array(np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32))
    quant = QUANT[name]
    try:
        bad = build()
    except (ValueError, TypeError) as e:  # refused where the codes are built: the same contract
        assert isinstance(e, err) and all(w in str(e) for w in words), e
        return
    for call in (lambda: quant.decode(bad), lambda: quant.decode_rotated(bad),
                 lambda: quant.estimate_inner_product(q, bad), lambda: quant.estimate_inner_product(q[0], bad)):
        with pytest.raises(err) as e:
            mx.eval(call())
        assert all(w in str(e.value) for w in words), e.value
