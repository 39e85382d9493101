"""Packed caches wired to attention on codes: same tokens and logits with and without the hook.

Inside ``use_packed_attention()`` a packed cache's ``update_and_fetch`` returns placeholders and mlx_lm's
SDPA is routed to ``attend_packed``, which reads the codes. Every such call is checked against SDPA on
the same cache's decoded history (same stored state, real mlx_lm masks): equal up to float32 rounding.
Whole runs with and without the hook drift apart a little more: codes are discontinuous, so a
rounding-level difference in a token coded during the run can move one of its codes by a quantization
step (seen: one value code of one token, 1.5e-2 relative on the logits); greedy tokens must still match
and logits stay within ``FREE_RUN_TOL``.
Tiny random mlx_lm models are built in-process; all weights but q/k projections are scaled up so greedy
decoding visits several tokens (flat logits would make any comparison trivially pass).
"""
from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map_with_path
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import gemma3_text, llama

from veloxquant_mlx import use_packed_attention
from veloxquant_mlx.codecs import AffineRotatedCodec, LloydMaxCodec
from veloxquant_mlx.integration.scan import attention_is_routable
from veloxquant_mlx.integration.builder import make_prompt_cache
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from veloxquant_mlx.cache.prompt_cache_io import load_prompt_cache, save_prompt_cache
from veloxquant_mlx.compat.config import KVCacheConfig
from _packed_attention_helpers import banded_sdpa_reference

PROMPT_LEN, CHUNK, STEPS = 48, 8, 12  # long enough for affine_block to code blocks of 32 tokens
REL_TOL = 1e-4
FREE_RUN_TOL = 5e-2
CODECS = ("lloyd_max", "affine", "affine_block")


def build_model(name: str):
    mx.random.seed(1)
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=96)
    if name == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, head_dim=32,
                                            **base))
    else:  # gemma3: layers 0, 1 slide over 8 tokens (rotating caches evict), layer 2 is global
        model = gemma3_text.Model(gemma3_text.ModelArgs(
            model_type="gemma3_text", num_hidden_layers=3, head_dim=32, sliding_window=8,
            sliding_window_pattern=3, query_pre_attn_scalar=32, **base))
    boost = lambda path, w: w if w.ndim < 2 or "q_proj" in path or "k_proj" in path else 4.0 * w  # noqa: E731
    model.update(tree_map_with_path(boost, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def llama_model():
    return build_model("llama")


@pytest.fixture(scope="module")
def gemma_model():
    return build_model("gemma3")


def prompt(batch: int) -> mx.array:
    rows = [[(7 * i + 3 * b + 1) % 96 for i in range(PROMPT_LEN)] for b in range(batch)]
    return mx.array(rows)


def prefill(model, cache, tokens: mx.array) -> mx.array:
    """Chunked prefill of ``tokens`` (B, L); returns the last position's logits (B, V)."""
    for start in range(0, tokens.shape[1], CHUNK):
        logits = model(tokens[:, start : start + CHUNK], cache=cache)
        mx.eval(logits)
    return logits[:, -1]


def decode(model, cache, logits: mx.array, steps: int):
    """Greedy steps from ``logits``; returns (tokens (B, steps) list, stacked logits (steps, B, V), last logits)."""
    toks, seen = [], []
    for _ in range(steps):
        tok = mx.argmax(logits, axis=-1)
        toks.append(tok)
        logits = model(tok[:, None], cache=cache)[:, -1]
        seen.append(logits)
        mx.eval(logits)
    return mx.stack(toks, axis=1).tolist(), mx.stack(seen), logits


def assert_close(a: mx.array, b: mx.array, tol: float = REL_TOL):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    err = np.abs(a - b).max() / np.abs(b).max()
    assert err <= tol, f"relative logit difference {err:.2e} > {tol}"


@pytest.fixture
def count_packed(monkeypatch):
    """Counts attend_packed calls, checks each against SDPA on the decoded history of the same cache
    (relative errors in ``calls["errors"]``), and forbids decoding the history while the hook routes attention."""
    calls = {"attend": 0, "errors": []}
    attend, fetch = TurboQuantPackedCache.attend_packed, TurboQuantPackedCache._fetch

    def spy_attend(self, queries, scale, mask, *a, **k):
        calls["attend"] += 1
        out = attend(self, queries, scale, mask, *a, **k)
        keys, values = fetch(self, mx.float32)
        ref = banded_sdpa_reference(self, queries.astype(mx.float32), keys, values, scale, mask)
        err = mx.abs(out.astype(mx.float32) - ref).max() / mx.abs(ref).max()
        calls["errors"].append(float(err))
        return out

    def guarded_fetch(self, dtype):
        from veloxquant_mlx.attention import is_active

        if is_active():
            raise AssertionError("history decoded although the hook is active")
        return fetch(self, dtype)

    monkeypatch.setattr(TurboQuantPackedCache, "attend_packed", spy_attend)
    monkeypatch.setattr(TurboQuantPackedCache, "_fetch", guarded_fetch)
    return calls


def options(codec: str, **extra):
    return dict(codec=codec, k_bits=4, v_bits=4, **extra)


def distinct_tokens(tokens) -> int:
    return len({t for row in tokens for t in row})


@pytest.mark.parametrize("codec", CODECS)
def test_llama_same_tokens_and_logits_with_and_without_hook(llama_model, codec, count_packed):
    # (no exact window: with one, a chunk's queries read their newest keys exact on codes only, which the decoded
    # history cannot show; `test_llama_chunks_read_their_exact_band` checks that path call by call)
    p = prompt(2)
    opts = options(codec, sink=2, trim_headroom=2)
    ref_cache = make_prompt_cache(llama_model, route_attention=False, **opts)
    ref_toks, ref_logits, _ = decode(llama_model, ref_cache, prefill(llama_model, ref_cache, p), STEPS)
    assert count_packed["attend"] == 0
    assert distinct_tokens(ref_toks) >= 3, "the tiny model must not be degenerate"

    cache = make_prompt_cache(llama_model, route_attention=False, **opts)  # routed only inside the block
    assert all(c.fetch_placeholders for c in cache)
    with use_packed_attention():
        toks, logits, last = decode(llama_model, cache, prefill(llama_model, cache, p), STEPS)
    n_layers = len(llama_model.layers)
    assert count_packed["attend"] == n_layers * (PROMPT_LEN // CHUNK + STEPS)
    assert max(count_packed["errors"]) <= REL_TOL
    assert toks == ref_toks
    assert_close(logits, ref_logits, FREE_RUN_TOL)
    assert all(c.n_coded > 0 for c in cache), "tokens must really have been coded"

    # Outside the context the same caches go on through update_and_fetch (decoded history).
    before = count_packed["attend"]
    ref_more, ref_more_logits, _ = decode(llama_model, ref_cache, ref_logits[-1], 4)
    more, more_logits, _ = decode(llama_model, cache, last, 4)
    assert count_packed["attend"] == before
    assert more == ref_more
    assert_close(more_logits, ref_more_logits, FREE_RUN_TOL)


@pytest.mark.parametrize("codec", CODECS)
def test_llama_chunks_read_their_exact_band(llama_model, codec, count_packed):
    """With an exact window, every attention call on codes (prompt chunks and decode steps) equals SDPA on the
    decoded history in which each chunk query reads its ``recent`` newest keys from the chunk's exact copies."""
    cache = make_prompt_cache(llama_model, route_attention=False, **options(codec, sink=2, recent=4, trim_headroom=2))
    with use_packed_attention():
        toks, _, _ = decode(llama_model, cache, prefill(llama_model, cache, prompt(2)), STEPS)
    assert count_packed["attend"] == len(llama_model.layers) * (PROMPT_LEN // CHUNK + STEPS)
    assert max(count_packed["errors"]) <= REL_TOL
    assert distinct_tokens(toks) >= 3 and all(c.n_coded > 0 for c in cache)


@pytest.mark.parametrize("codec", CODECS)
def test_gemma3_rotating_same_tokens_and_logits(gemma_model, codec, count_packed):
    p = prompt(2)
    opts = options(codec, recent=2, trim_headroom=1)
    ref_cache = make_prompt_cache(gemma_model, **opts)
    assert any(isinstance(c, TurboQuantRotatingPackedCache) for c in ref_cache)
    ref_toks, ref_logits, _ = decode(gemma_model, ref_cache, prefill(gemma_model, ref_cache, p), STEPS)
    assert distinct_tokens(ref_toks) >= 3

    cache = make_prompt_cache(gemma_model, **opts)
    with use_packed_attention():
        toks, logits, _ = decode(gemma_model, cache, prefill(gemma_model, cache, p), STEPS)
    assert count_packed["attend"] > 0
    assert max(count_packed["errors"]) <= REL_TOL
    assert toks == ref_toks
    assert_close(logits, ref_logits, FREE_RUN_TOL)
    rotating = [c for c in cache if isinstance(c, TurboQuantRotatingPackedCache)]
    assert all(c.size() == c.max_size for c in rotating), "the sliding windows must have evicted"


def test_affine_caches_hold_affine_codecs_and_count_every_byte(llama_model):
    cache = make_prompt_cache(llama_model, **options("affine", sink=1))
    with use_packed_attention():
        prefill(llama_model, cache, prompt(1))
    for c in cache:
        assert isinstance(c.k_codec, AffineRotatedCodec) and isinstance(c.v_codec, AffineRotatedCodec)
        arrays = [a for n, a in c.state.items() if n != "meta"]
        assert c.live_nbytes == sum(a.nbytes for a in arrays)
        assert c.nbytes >= c.live_nbytes
        # The stored layout, counted by hand: exact sink and tail tokens in the model dtype; per coded token and
        # head 4-bit codes + a float16 scale and bias per group, for K and for V; the fitted float32 means.
        B, H = c.rows.v_codes.arrays["w_q"].shape[:2]
        d, gs = c.dims[0], c.k_codec.group_size
        exact = (c.rows.sink_n[0] + c.rows.tail_n[0]) * 2 * d * 4
        coded = c.n_coded * 2 * (d * 4 // 8 + 2 * 2 * (d // gs))
        stored = B * H * (exact + coded) + 2 * H * d * 4
        assert c.live_nbytes == stored
        assert c.bits_per_coordinate() == pytest.approx(8 * stored / (B * H * c.offset * 2 * d), rel=1e-12)
    lm = make_prompt_cache(llama_model, k_bits=4)
    with use_packed_attention():
        prefill(llama_model, lm, prompt(1))
    assert isinstance(lm[0].k_codec, LloydMaxCodec)


@pytest.mark.parametrize("codec", CODECS)
def test_save_load_and_deepcopy_continue_identically(llama_model, codec, tmp_path):
    cache = make_prompt_cache(llama_model, **options(codec, recent=3))
    with use_packed_attention():
        logits = prefill(llama_model, cache, prompt(1))
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    copied = copy.deepcopy(cache)
    for a, b in zip(cache, loaded):
        assert type(a.k_codec) is type(b.k_codec) and a.codec == b.codec == codec
    with use_packed_attention():
        ref, ref_logits, _ = decode(llama_model, cache, logits, 6)
        got, got_logits, _ = decode(llama_model, loaded, logits, 6)
        dup, dup_logits, _ = decode(llama_model, copied, logits, 6)
    assert got == ref and dup == ref
    assert_close(got_logits, ref_logits)
    assert_close(dup_logits, ref_logits)


def test_model_bypassing_the_hook_gets_decoding_caches():
    class Stub:  # a model file that calls mx.fast.scaled_dot_product_attention itself
        layers = [None]

        def make_cache(self):
            return [mlx_cache.KVCache()]

    Stub.__module__ = "mlx_lm.models.deepseek_v41"
    import mlx_lm.models.deepseek_v41  # noqa: F401  (its source is what gets inspected)

    assert not attention_is_routable(Stub())
    (cache,) = make_prompt_cache(Stub(), k_bits=4)
    assert cache.fetch_placeholders is False
    k = mx.random.normal((1, 2, 5, 16))
    with use_packed_attention():
        keys, _ = cache.update_and_fetch(k, k)
    assert float(mx.abs(keys - k).max()) < 0.5  # a real (decoded) history, not zeros


def test_unrouted_placeholders_fail_loudly(llama_model):
    assert attention_is_routable(llama_model)
    cache = TurboQuantPackedCache(KVCacheConfig(bit_width_inlier=4))
    k = mx.random.normal((1, 2, 4, 16))
    with use_packed_attention():
        keys, _ = cache.update_and_fetch(k, k)
        assert keys.shape == k.shape and float(mx.abs(keys).max()) == 0.0  # placeholder
        # Nobody called attend_packed (a model using mx.fast SDPA directly): the next update refuses.
        with pytest.raises(RuntimeError, match="attend_packed was never called"):
            cache.update_and_fetch(k[:, :, :1], k[:, :, :1])


def test_bad_codec_options_raise():
    cfg = KVCacheConfig(bit_width_inlier=4)
    with pytest.raises(ValueError, match="codec"):
        TurboQuantPackedCache(cfg, codec="nf4")
    with pytest.raises(ValueError, match="k_bits"):
        TurboQuantPackedCache(KVCacheConfig(bit_width_inlier=7), codec="affine")
    with pytest.raises(ValueError, match="outlier"):
        TurboQuantPackedCache(KVCacheConfig(bit_width_inlier=4, n_outlier_channels=4), codec="affine")
    with pytest.raises(ValueError, match="group_size"):
        TurboQuantPackedCache(cfg, group_size=32)
    with pytest.raises(TypeError, match="fetch_placeholders"):
        TurboQuantPackedCache(cfg, fetch_placeholders="yes")


@pytest.mark.parametrize("blocks", ["several", "one"])
@pytest.mark.parametrize("mask", ["causal", "window", "array"])
def test_long_chunks_attend_in_query_blocks_with_the_same_result(mask, blocks, monkeypatch):
    from veloxquant_mlx.attention import packed_sdpa

    # "several": the 4096-key block length at 92 keys; "one": this short history's own (the whole chunk)
    if blocks == "several":
        monkeypatch.setattr(packed_sdpa, "BLOCK_SCORES", packed_sdpa.QUERY_BLOCK)
    calls = []
    attend = packed_sdpa._attend
    monkeypatch.setattr(packed_sdpa, "_attend", lambda q, *a: calls.append(q.shape[2]) or attend(q, *a))
    mx.random.seed(3)
    B, Hkv, R, n, d = 2, 2, 3, 90, 32
    L = packed_sdpa.QUERY_BLOCK * 2 + 5  # several blocks, a ragged last one
    k, v = mx.random.normal((B, Hkv, n, d)), mx.random.normal((B, Hkv, n, d))
    q = mx.random.normal((B, Hkv * R, L, d))
    kc, vc = AffineRotatedCodec(d, 4), AffineRotatedCodec(d, 4, seed=7)
    kc.fit(k)
    vc.fit(v)
    sink = (mx.random.normal((B, Hkv, 2, d)), mx.random.normal((B, Hkv, 2, d)))
    m, window = {"causal": ("causal", None), "window": ("causal", 40),
                 "array": (mx.random.uniform(shape=(B, 1, L, n + 2)) > 0.3, None)}[mask]
    args = (q, kc, kc.encode(k), vc, vc.encode(v), d ** -0.5, m)
    blocked = packed_sdpa.coded_attention(*args, sink=sink, window_size=window)  # CPU default: blocked
    assert calls == ([packed_sdpa.QUERY_BLOCK] * 2 + [5] if blocks == "several" else [L])
    whole = packed_sdpa.coded_attention(*args, sink=sink, window_size=window, packed_rows=10**6)
    assert float(mx.abs(blocked - whole).max()) < 1e-5 * float(mx.abs(whole).max()) + 1e-6


def test_attend_packed_rejects_bad_queries_clearly():
    cache = TurboQuantPackedCache(KVCacheConfig(bit_width_inlier=4), codec="affine_block", sink=2)
    k = mx.random.normal((1, 2, 100, 64))
    cache.update_and_fetch(k, k)
    with pytest.raises(TypeError, match="queries"):
        cache.attend_packed([1.0, 2.0], 0.1, None)
    with pytest.raises(ValueError, match="queries"):
        cache.attend_packed(mx.zeros((2, 64)), 0.1, None)
