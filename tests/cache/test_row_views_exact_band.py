"""A chunk reads each query's ``recent`` newest keys exact (`with_exact_band`): a cache keeping its newest tokens
exact attends a prompt chunk exactly as it attends the same tokens decoded one at a time (per-token codes are
stored the same either way, so the outputs agree to float32 rounding)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import use_packed_attention
from veloxquant_mlx.attention import packed_sdpa
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart, packed_attention
from veloxquant_mlx.attention.parts import NEG, with_exact_band
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from veloxquant_mlx.codecs.affine import AffineRotatedCodec

H, HQ, D, T = 2, 4, 64, 120
# uncentred: nothing is fitted on the first tokens, so what is stored does not depend on the chunking
OPTIONS = dict(codec="affine", k_bits=4, v_bits=4, recent=8, center_keys=False, center_values=False)


def _data(B=1, seed=0):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal(s), mx.float32) for s in ((B, H, T, D), (B, H, T, D), (B, HQ, T, D))]


def _attend_in_chunks(make, chunks, k, v, q):
    cache, outs, s = make(), [], 0
    with use_packed_attention():
        for n in chunks:
            mask = cache.make_mask(n) if n > 1 else None  # (mlx_lm asks for the mask before the update)
            cache.update_and_fetch(k[:, :, s:s + n], v[:, :, s:s + n])
            outs.append(cache.attend_packed(q[:, :, s:s + n], D ** -0.5, mask))
            s += n
    return mx.concatenate(outs, axis=2)


MAKERS = {
    "full": lambda **o: TurboQuantPackedCache(**{**OPTIONS, **o}),
    "window": lambda **o: TurboQuantRotatingPackedCache(max_size=48, **{**OPTIONS, **o}),
}


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("chunks", [[T], [50, 1, 1, 68], [7, 60, 53]])
@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("blocks", ["one", "many"])
def test_a_chunk_attends_as_its_tokens_decoded_one_at_a_time(kind, chunks, B, blocks, monkeypatch):
    if blocks == "many":  # long chunks attend in query blocks, each with the copies it reads (`banded_attention`)
        monkeypatch.setattr(packed_sdpa, "BLOCK_SCORES", 16 * 16)
    k, v, q = _data(B)
    one_by_one = _attend_in_chunks(MAKERS[kind], [1] * T, k, v, q)
    chunked = _attend_in_chunks(MAKERS[kind], chunks, k, v, q)
    assert mx.allclose(chunked, one_by_one, atol=2e-5).item(), float(mx.abs(chunked - one_by_one).max())


def test_without_an_exact_window_a_chunk_reads_its_own_codes():
    """The band belongs to ``recent``: with none, a chunk's queries read what is stored (codes), so chunked and
    one-at-a-time differ (the per-token steps then keep up to ``code_batch - 1`` newest tokens exact)."""
    k, v, q = _data()
    make = lambda: TurboQuantPackedCache(**{**OPTIONS, "recent": 0})  # noqa: E731
    one_by_one = _attend_in_chunks(make, [1] * T, k, v, q)
    chunked = _attend_in_chunks(make, [T], k, v, q)
    assert float(mx.abs(chunked - one_by_one).max()) > 1e-2


def test_the_band_shows_each_query_its_newest_coded_keys_from_the_copy():
    """The mask: a coded position among a query's ``recent`` newest is read from the copy, never from both; exact
    parts keep their own; an additive mask becomes the same additive mask."""
    rng = np.random.default_rng(1)
    exact = lambda n: ExactPart(*(mx.array(rng.standard_normal((1, 1, n, 32)), mx.float32) for _ in range(2)))  # noqa
    codec = AffineRotatedCodec(32, 4)
    coded = CodedPart(codec, codec.encode(exact(6).keys), codec, codec.encode(exact(6).values))
    parts = [exact(2), coded, exact(3)]  # positions 0-1 exact (sink), 2-7 coded, 8-10 exact (tail)
    band = exact(5)  # copies of positions 6..10
    got_parts, mask = with_exact_band(parts, band, recent=4, L=4, mask="causal")
    assert got_parts[-1] is band and mask.shape == (4, 11 + 5)
    m = np.array(mask)
    for l in range(4):
        p = 7 + l  # query positions 7..10
        for j in range(11):
            from_copy = j >= 6 and 2 <= j < 8 and p - j < 4 and j <= p
            assert m[l, j] == (j <= p and not from_copy), (l, j)
            if j >= 6:
                assert m[l, 11 + j - 6] == from_copy, (l, j)
    additive = mx.where(mx.array(np.tril(np.ones((4, 11)), 7) > 0), 0.0, NEG)
    _, add_mask = with_exact_band(parts, band, recent=4, L=4, mask=additive)
    assert mx.array_equal(add_mask == 0, mask).item()
    q = mx.array(rng.standard_normal((1, 2, 4, 32)), mx.float32)
    a = packed_attention(q, got_parts, 0.5, mask)
    b = packed_attention(q, got_parts, 0.5, add_mask)
    assert mx.allclose(a, b, atol=1e-6).item()


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("blocks", ["one", "many"])
def test_a_batch_chunk_attends_each_row_as_decoded_alone(kind, blocks, monkeypatch):
    """mlx_lm's BatchGenerator protocol (left padding, then a second chunk): each row's real queries read their
    newest keys exact, as the row decoded one token at a time alone."""
    if blocks == "many":
        monkeypatch.setattr(packed_sdpa, "BLOCK_SCORES", 16 * 16)
    lengths = (70, 33)
    k, v, q = _data(B=2, seed=3)
    single = MAKERS[kind]
    batch = type(single()).merge([single() for _ in lengths])
    batch.prepare(left_padding=[70 - n for n in lengths])
    with use_packed_attention():
        ks = mx.concatenate([mx.concatenate([mx.zeros((1, H, 70 - n, D)), k[i:i + 1, :, :n]], axis=2)
                             for i, n in enumerate(lengths)])
        vs = mx.concatenate([mx.concatenate([mx.zeros((1, H, 70 - n, D)), v[i:i + 1, :, :n]], axis=2)
                             for i, n in enumerate(lengths)])
        qs = mx.concatenate([mx.concatenate([mx.zeros((1, HQ, 70 - n, D)), q[i:i + 1, :, :n]], axis=2)
                             for i, n in enumerate(lengths)])
        batch.update_and_fetch(ks, vs)
        first = batch.attend_packed(qs, D ** -0.5, "causal")
        batch.finalize()
        nxt = [mx.stack([k[i, :, n:n + 20] for i, n in enumerate(lengths)]) for k in (k, v, q)]
        batch.update_and_fetch(nxt[0], nxt[1])
        second = batch.attend_packed(nxt[2], D ** -0.5, "causal")
    for i, n in enumerate(lengths):
        alone = _attend_in_chunks(single, [1] * (n + 20), k[i:i + 1, :, :n + 20], v[i:i + 1, :, :n + 20],
                                  q[i:i + 1, :, :n + 20])
        assert mx.allclose(first[i:i + 1, :, 70 - n:], alone[:, :, :n], atol=2e-5).item()
        assert mx.allclose(second[i:i + 1], alone[:, :, n:], atol=2e-5).item()
