"""TurboQuantPackedCache / TurboQuantRotatingPackedCache, continued: the rotating cache against mlx_lm's
RotatingKVCache, codec="affine_block" (keys coded in whole blocks of tokens) and a coded tail (issue 47).
"""
from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import RotatingKVCache

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from _packed_cache_helpers import cfg, kv, rel_err, assert_same_stored_tokens, attend, DB, block_cache, _budget


@settings(max_examples=20, deadline=None)
@given(
    chunks=st.lists(st.sampled_from([1, 1, 1, 2, 3, 7]), min_size=1, max_size=12),
    max_size=st.integers(3, 9),
    keep=st.integers(0, 2),
)
def test_rotating_matches_mlx_lm_with_exact_windows(chunks, max_size, keep):
    # recent >= max_size keeps every token exact, so the outputs must match RotatingKVCache closely.
    ours = TurboQuantRotatingPackedCache(cfg(), max_size=max_size, keep=keep, recent=max_size + 8)
    ref = RotatingKVCache(max_size=max_size, keep=keep)
    for i, T in enumerate(chunks):
        k, v = kv(T=T, seed=i)
        q = kv(T=T, seed=100 + i)[0]
        out_ref = attend(ref, q, k, v)
        out = attend(ours, q, k, v)
        assert mx.allclose(out, out_ref, atol=1e-5), (i, T)
        assert ours.offset == ref.offset and ours.size() == ref.size()
        assert ours.is_trimmable() == ref.is_trimmable()


def test_rotating_keeps_its_window_coded():
    cache = TurboQuantRotatingPackedCache(
        cfg(bit_width_inlier=8), max_size=6, keep=2, sink=1, recent=2, trim_headroom=0
    )
    ks = []
    for i in range(12):
        k, v = kv(T=1, seed=i)
        ks.append(k)
        keys, _ = cache.update_and_fetch(k, v)
    expect = mx.concatenate(ks[:2] + ks[-4:], axis=2)  # keep 2 + newest 4
    assert keys.shape[2] == 6 and cache.size() == 6 and not cache.is_trimmable()
    assert mx.array_equal(keys[:, :, :1], expect[:, :, :1])  # sink: exact
    assert mx.array_equal(keys[:, :, -2:], expect[:, :, -2:])  # recent: exact
    assert rel_err(keys, expect) < 0.02  # the rest: 8-bit codes
    assert cache.n_coded == 3
    restored = TurboQuantRotatingPackedCache.from_state(cache.state)
    assert (restored.max_size, restored.keep, restored.offset) == (6, 2, 12)


def test_block_codec_codes_whole_blocks_and_reads_the_rest_exactly():
    cache = block_cache(sink=1, trim_headroom=2)
    k, v = kv(T=100, d=DB, offset=0.5)
    keys, values = cache.update_and_fetch(k, v)
    # 99 non-sink tokens: 3 blocks of 32 coded once 2 (headroom) newer ones exist; 3 stay exact.
    assert (cache.rows.sink_n[0], cache.n_coded, cache.rows.tail_n[0]) == (1, 96, 3)
    assert cache.rows.k_codes.arrays["w_q"].shape == (1, 2, DB, 96 * 4 // 32)
    assert cache.rows.k_codes.arrays["scales"].shape == (1, 2, DB, 3)
    exact = [0, 97, 98, 99]
    assert mx.array_equal(keys[:, :, exact], k[:, :, exact]) and mx.array_equal(values[:, :, exact], v[:, :, exact])
    # 4-bit codes: measured 0.071 (keys) / 0.081 (values); 3 bits give 0.151 / 0.169, 5 bits 0.035 / 0.038.
    assert 0.05 < rel_err(keys[:, :, 1:97], k[:, :, 1:97]) < 0.1 and 0.05 < rel_err(values[:, :, 1:97], v[:, :, 1:97]) < 0.1
    arrays = [a for n, a in cache.state.items() if n != "meta"]
    assert cache.live_nbytes == sum(a.nbytes for a in arrays)


@settings(max_examples=10, deadline=None)
@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=6))
def test_block_codec_chunking_does_not_change_the_stored_tokens(chunks):
    # The codecs are fitted when the first block is coded (here by the first 60 tokens); after that, how
    # tokens arrive does not change what is stored.
    first, rest = kv(T=60, d=DB, seed=0), kv(T=sum(chunks), d=DB, seed=1)
    a, b = block_cache(sink=2), block_cache(sink=2)
    for c in (a, b):
        c.update_and_fetch(*first)
    assert_same_stored_tokens(a, b, rest, chunks)


@pytest.mark.parametrize("n", [1, 3, 20, 45, 200])
def test_block_codec_trim_into_the_codes_keeps_every_surviving_token(n):
    cache = block_cache(sink=2, trim_headroom=2)
    keys, values = cache.update_and_fetch(*kv(T=110, d=DB))
    assert cache.trim(n) == min(n, 110)
    left = 110 - min(n, 110)
    assert cache.offset == left == cache.rows.sink_n[0] + cache.n_coded + cache.rows.tail_n[0]
    assert cache.n_coded % 32 == 0 and cache.n_coded == cache.rows.k_codes.capacity == cache.k_codec.n_tokens(cache.rows.k_codes.arrays)
    if left:
        k2, v2 = cache._fetch(mx.float32)
        # Survivors of a cut block come back as their decoded values: the history reads as before.
        assert mx.allclose(k2, keys[:, :, :left], atol=1e-5) and mx.allclose(v2, values[:, :, :left], atol=1e-5)
    k3, _ = cache.update_and_fetch(*kv(T=70, d=DB, seed=3))
    assert k3.shape[2] == left + 70 and cache.n_coded % 32 == 0


def test_block_codec_state_round_trip_and_rotating_refusal():
    cache = block_cache(sink=1, recent=2)
    cache.update_and_fetch(*kv(B=2, T=75, d=DB))
    restored, twin = TurboQuantPackedCache.from_state(cache.state), copy.deepcopy(cache)
    nxt = kv(B=2, T=40, d=DB, seed=5)
    a, b, c = cache.update_and_fetch(*nxt), restored.update_and_fetch(*nxt), twin.update_and_fetch(*nxt)
    for x in (b, c):
        assert mx.array_equal(a[0], x[0]) and mx.array_equal(a[1], x[1])
    # Value codes grow a whole block at a time, so attention reads whole arrays (no slices): also after a restore.
    for x in (cache, restored, twin):
        assert x.n_coded == x.rows.v_codes.capacity == 96
        whole = x.rows.v_codes.folded(96)  # (two sequences folded into the heads: a reshape of each whole array)
        assert all(whole[n].shape == (1, 2 * a.shape[1]) + a.shape[2:] and whole[n].size == a.size
                   for n, a in x.rows.v_codes.arrays.items())
    with pytest.raises(ValueError, match="affine_block"):
        TurboQuantRotatingPackedCache(cfg(), max_size=64, codec="affine_block")


def test_budget_layout_stores_its_waiting_tokens_as_codes():
    """tq-4b's tokens waiting for their 128-token key block: keys as provisional per-token codes, values as the value
    codec's codes, which move unchanged into the value store when the block completes (no second rounding); the
    completed block's keys are coded from the provisional codes. Only the sink is held as floats."""
    from veloxquant_mlx.codecs.kblock_tail import provisional_bits

    k, v = kv(H=2, T=300, d=64, seed=3)
    cache = TurboQuantPackedCache(_budget(4), fetch_placeholders=False)
    cache.update_and_fetch(k[:, :, :200], v[:, :, :200])
    r = cache.rows
    assert (r.sink_n[0], cache.n_coded, r.tail_n[0]) == (1, 128, 71)
    assert r.tail.coder is not None and set(r.tail.raw.buffers) == {"k_w_q", "k_scales", "v_w_q", "v_scales"}
    assert all(a.dtype in (mx.uint32, mx.uint8) for a in r.tail.raw.buffers.values())
    assert r.tail.coder.k.bits == provisional_bits(4, type(r.k_codec).TAIL_EXTRA_BITS) > 4
    # the waiting values are the value codec's codes of the tokens, exactly
    want_v = r.v_codec.encode(v[:, :, 129:200])
    got = r.tail.live_arrays()
    assert all(mx.array_equal(got["v_" + f], a).item() for f, a in want_v.items())
    cache.update_and_fetch(k[:, :, 200:300], v[:, :, 200:300])
    assert (cache.n_coded, r.tail_n[0]) == (256, 43)
    # block 2 (tokens 129..256): values as coded on arrival; keys from the provisional codes' reconstruction
    blk_v = r.v_codec.encode(v[:, :, 129:257])
    stored_v = r.v_codec.slice_tokens(r.v_codes.arrays, 128, 256)
    assert all(mx.array_equal(stored_v[f], a).item() for f, a in blk_v.items())
    prov = r.tail.coder.k.decode(r.tail.coder.k.encode(k[:, :, 129:257]), mx.float32)
    blk_k = r.k_codec.encode(prov)
    stored_k = r.k_codec.slice_tokens(r.k_codes.arrays, 128, 256)
    assert all(mx.array_equal(stored_k[f], a).item() for f, a in blk_k.items())
    # attention on the stored form (codes and provisional codes) = attention over the decoded history
    hk, hv = cache.keys_and_values()
    assert rel_err(hk, k) < 0.12 and rel_err(hv, v) < 0.12  # (4-bit codes of Gaussian data: ~0.1)
    assert mx.array_equal(hk[:, :, :1], k[:, :, :1]).item()  # the sink is exact
    q = kv(H=2, T=1, d=64, seed=9)[0]
    ref = mx.fast.scaled_dot_product_attention(q, hk, hv, scale=0.125)
    assert rel_err(cache.attend_packed(q, 0.125, None), ref) < 1e-4


def test_coded_tail_costs_its_codes_not_floats():
    """At 2048 tokens (127 waiting) tq-Nb store at most their budget; the exact tail of the old layout did not."""
    from veloxquant_mlx.cache.presets import BUDGETS

    k, v = kv(H=3, T=2048, d=64, seed=1)
    for bits in (4, 3, 2):
        coded, exact = (TurboQuantPackedCache(_budget(bits, c)) for c in ("kblock_vsym8_pt", "kblock_vsym8"))
        for c in (coded, exact):
            for s in range(0, 2048, 256):
                c.update_and_fetch(k[:, :, s:s + 256], v[:, :, s:s + 256])
            assert c.rows.tail_n[0] == 127
        assert coded.bits_per_coordinate() <= BUDGETS[f"tq-{bits}b"] < exact.bits_per_coordinate() - 1.5
        tail_bytes = coded.rows.tail.nbytes
        assert tail_bytes < exact.rows.tail.nbytes / 4


def test_coded_tail_is_exact_until_the_first_block_and_again_after_a_trim_below_it():
    """A short chat (no complete key block yet) holds and attends exactly what the exact-tail layout does (mlx_lm's
    own answers); the first block is coded from exact tokens, then the waiting tokens are codes (the budget holds);
    a trim back below the first block makes them exact again (as decoded); a state saved either way restores."""
    k, v = kv(H=2, T=260, d=64, seed=6)
    coded, exact = (TurboQuantPackedCache(_budget(4, c)) for c in ("kblock_vsym8_pt", "kblock_vsym8"))
    q = kv(H=2, T=1, d=64, seed=7)[0]
    for t in range(0, 128):  # a token at a time: 1 sink + 127 waiting, no block
        for c in (coded, exact):
            c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert coded.rows.tail.coder is None and coded.n_coded == 0
    short_out = exact.attend_packed(q, 0.125, None)
    assert mx.array_equal(coded.attend_packed(q, 0.125, None), short_out).item()
    assert coded.live_nbytes == exact.live_nbytes
    short_state = coded.state
    for c in (coded, exact):
        c.update_and_fetch(k[:, :, 128:129], v[:, :, 128:129])  # the first block is coded: from exact tokens
    assert coded.n_coded == exact.n_coded == 128 and coded.rows.tail.coder is not None
    assert all(mx.array_equal(a, b).item() for a, b in zip(coded.rows.k_codes.arrays.values(),
                                                            exact.rows.k_codes.arrays.values()))
    for t in range(129, 260):
        coded.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert coded.n_coded == 256 and coded.rows.tail_n[0] == 3 and coded.rows.tail.coder is not None
    before = coded.keys_and_values()
    assert coded.trim(140) == 140  # 3 waiting + 128 of the second block + 9 of the first: no block left
    assert coded.n_coded == 0 and coded.rows.tail.coder is None and coded.rows.tail_n[0] == 119
    after = coded.keys_and_values()
    assert all(mx.array_equal(a, b[:, :, :120]).item() for a, b in zip(after, before))  # (as they decoded)
    back = TurboQuantPackedCache.from_state(short_state)
    assert back.rows.tail.coder is None and back.offset == 128
    assert mx.array_equal(back.attend_packed(q, 0.125, None), short_out).item()
    again = TurboQuantPackedCache.from_state(coded.state)
    assert again.rows.tail.coder is None and again.offset == 120


def test_coded_tail_state_round_trip_trim_and_refusal():
    """A coded tail saves as codes (``t_k_*``, ``t_v_*``) and restores bit for bit; a trim into a coded block
    returns its survivors to the tail as provisional codes; a state holding an exact tail for this layout (or a coded
    one for the exact layout) is refused, naming what was expected."""
    k, v = kv(H=2, T=300, d=64, seed=4)
    cache = TurboQuantPackedCache(_budget(3))
    cache.update_and_fetch(k, v)
    state = cache.state
    assert {n for n in state if n.startswith("t_")} == {"t_k_w_q", "t_k_scales", "t_v_w_q", "t_v_scales"}
    back = TurboQuantPackedCache.from_state(state)
    assert all(mx.array_equal(a, b).item() for a, b in zip(cache.keys_and_values(), back.keys_and_values()))
    assert back.live_nbytes == cache.live_nbytes
    # an exact tail where codes are expected: refused clearly
    bad = {n: a for n, a in state.items() if not n.startswith("t_")}
    hk, hv = cache.keys_and_values()
    bad.update({"t_k": hk[:, :, -43:], "t_v": hv[:, :, -43:]})
    with pytest.raises(ValueError, match="stores the tokens waiting for their key block as codes"):
        TurboQuantPackedCache.from_state(bad)
    # trim 50: 43 tail tokens, then 7 of the last coded block; its 121 survivors wait again as provisional codes
    before = cache.keys_and_values()[0]
    assert cache.trim(50) == 50
    assert (cache.n_coded, cache.rows.tail_n[0]) == (128, 121)
    assert cache.rows.tail.coder is not None and set(cache.rows.tail.raw.buffers) >= {"k_w_q", "v_w_q"}
    after = cache.keys_and_values()[0]
    assert after.shape[2] == 250 and rel_err(after, before[:, :, :250]) < 0.12
    cache.update_and_fetch(k[:, :, 250:260], v[:, :, 250:260])
    assert (cache.n_coded, cache.rows.tail_n[0]) == (256, 3)


@pytest.mark.parametrize("rotation", ["haar", "hadamard"])
def test_unrotated_block_keys_keep_a_mixing_rotation_in_their_coded_tail(rotation):
    """Block keys coded in the model's own channels (key_rotation="none", what the key-rotation probe picks for
    Gemma 3's full-attention layers) still code their waiting keys per token under the options' rotation (per-token
    codes need one); a coded tail saved by the version that coded them unrotated (format 3) is refused, naming it."""
    import dataclasses
    import json

    k, v = kv(H=2, T=300, d=64, seed=8)
    k = k * mx.array([8.0] + [0.5] * 63)  # one loud channel: unrotated per-token codes spend their levels on it
    opts = dataclasses.replace(_budget(4), rotation=rotation, key_rotation="none", center_keys=False)
    cache = TurboQuantPackedCache(opts)
    cache.update_and_fetch(k, v)
    assert cache.rows.k_codec.rotation_kind == "none"
    tail_codec = cache.rows.tail.coder.k
    assert tail_codec.rotation_kind == rotation
    assert cache.rows.tail_n[0] == 43
    err = rel_err(cache.keys_and_values()[0][:, :, -43:], k[:, :, -43:])
    unrotated = type(tail_codec)(64, tail_codec.bits, seed=tail_codec.seed, rotation="none")
    plain = unrotated.decode(unrotated.encode(k[:, :, -43:]), mx.float32)
    assert err < rel_err(plain, k[:, :, -43:]) / 1.5, (err, rel_err(plain, k[:, :, -43:]))
    state = cache.state
    back = TurboQuantPackedCache.from_state(state)
    assert all(mx.array_equal(a, b).item() for a, b in zip(cache.keys_and_values(), back.keys_and_values()))
    old = dict(state, meta=json.dumps({**json.loads(state["meta"]), "format": 3}))
    with pytest.raises(ValueError, match="coded waiting keys unrotated"):
        TurboQuantPackedCache.from_state(old)
