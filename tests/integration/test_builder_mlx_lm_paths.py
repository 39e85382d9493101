"""Our caches on every mlx_lm path, with tiny random models built in-process (no network).

Random tiny models have nearly flat logits, so greedy decoding would repeat one token and any cache
would "match". Every weight matrix except the query/key projections is multiplied by ``WEIGHT_SCALE`` (4):
the greedy sequence then varies (checked: several distinct tokens) while attention stays soft.

Even so, such models are chaotic: a 0.6 % relative perturbation of K and V (what 8-bit codes give, and
what plain Gaussian noise of that size gives too) moves their logits by a few percent of their spread,
and over 32 steps some top-1/top-2 gap is almost always smaller than that. So the 8-bit comparison is
made where greedy margins are meaningful: with the plain cache's tokens fed to both caches, our top-1 must
equal the plain cache's at every step whose plain top-1 margin is at least ``MARGIN`` x the logits' standard
deviation, and those steps must be the majority; free-running, our tokens must equal the plain cache's up
to the first near tie. A 1-bit cache fails the same check (see `test_one_bit_cache_fails_the_check`).

The logits themselves are bounded too: with the plain cache's tokens fed to both, max |logit_ours -
logit_plain| / std(logit_plain) over every step must stay below ``MAX_LOGIT_ERROR``. Measured over the 24
cases (4 models x 3 dtypes x batch 1, 2), worst case: 0.173 at 8 bits (gemma3 bfloat16), 0.393 at 6 bits,
1.19 at 4 bits (4 bits: at least 0.48 in every case). ``MAX_LOGIT_ERROR`` = 0.25 leaves 1.45x above the
8-bit worst and lies below the worst 6-bit and every 4-bit case (`test_lower_bits_exceed_the_logit_bound`).
"""
from __future__ import annotations

import copy
import math

import mlx.core as mx
import pytest
from mlx.utils import tree_map_with_path
from mlx_lm.generate import batch_generate, generate_step, speculative_generate_step, stream_generate
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import gemma3_text, llama, phi3, qwen3
from mlx_lm.tokenizer_utils import TokenizerWrapper

import veloxquant_mlx as vq
from fake_tokenizer import FakeTokenizer
from veloxquant_mlx.cache.registry import mlx_lm_cache_classes

WEIGHT_SCALE = 4.0
MARGIN = 0.15
MAX_LOGIT_ERROR = 0.25
N_TOKENS = 32
PROMPT = [(i * 37 + 11) % 128 for i in range(24)]
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def tiny_model(name: str, dtype=mx.float32, seed: int = 0):
    mx.random.seed(seed)
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, rms_norm_eps=1e-5)
    if name == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, **common))
    elif name == "qwen3":
        model = qwen3.Model(qwen3.ModelArgs(
            model_type="qwen3", num_hidden_layers=2, head_dim=16, tie_word_embeddings=True,
            max_position_embeddings=512, rope_theta=10000.0, **common))
    elif name == "phi3":
        model = phi3.Model(phi3.ModelArgs(model_type="phi3", num_hidden_layers=2, **common))
    elif name == "gemma3":
        # sliding_window=8 < prompt length: the rotating caches really evict during the test.
        common.pop("rms_norm_eps")
        model = gemma3_text.Model(gemma3_text.ModelArgs(
            model_type="gemma3_text", num_hidden_layers=3, head_dim=16, sliding_window=8,
            sliding_window_pattern=3, query_pre_attn_scalar=16, **common))
    else:
        raise ValueError(name)
    scale = lambda path, w: w * WEIGHT_SCALE if w.ndim >= 2 and not any(  # noqa: E731
        p in path for p in ("q_proj", "k_proj", "qkv_proj")) else w
    model.update(tree_map_with_path(scale, model.parameters()))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def greedy(model, cache, prompt, n=N_TOKENS):
    """Greedy decode for a (B, L) prompt; returns (tokens (B, n) as lists, last logits)."""
    logits = model(prompt, cache=cache)[:, -1]
    out = []
    for _ in range(n):
        tok = mx.argmax(logits, axis=-1)
        out.append(tok)
        logits = model(tok[:, None], cache=cache)[:, -1]
    return mx.stack(out, axis=1).tolist(), logits


def batch_prompt(batch):
    return mx.array([PROMPT] * batch) if batch == 1 else mx.array([PROMPT, PROMPT[::-1]])


# -- generation: 8-bit keys and values give the plain cache's greedy tokens ------------------------
def compare_greedy(model, options, batch, errors=None):
    """Run the plain cache greedily; feed its tokens to our cache too. Returns per-step facts
    (plain tokens, our tokens, plain top-1 confident) per row; ``errors`` (a list) receives each step's
    max |logit_ours - logit_plain| / std(logit_plain), a (batch,) list."""
    prompt = batch_prompt(batch)
    plain, ours = mlx_cache.make_prompt_cache(model), vq.make_prompt_cache(model, **options)
    lp, lo = model(prompt, cache=plain)[:, -1], model(prompt, cache=ours)[:, -1]
    steps = []
    for _ in range(N_TOKENS):
        lp32 = lp.astype(mx.float32)
        spread = mx.std(lp32, axis=-1)
        top2 = mx.sort(lp32, axis=-1)[:, -2:]
        confident = (top2[:, 1] - top2[:, 0]) >= MARGIN * spread
        tok = mx.argmax(lp, axis=-1)
        steps.append((tok.tolist(), mx.argmax(lo, axis=-1).tolist(), confident.tolist()))
        if errors is not None:
            errors.append((mx.max(mx.abs(lo.astype(mx.float32) - lp32), axis=-1) / spread).tolist())
        assert lo.dtype == lp.dtype
        lp, lo = model(tok[:, None], cache=plain)[:, -1], model(tok[:, None], cache=ours)[:, -1]
    return steps


def worst_logit_error(model, options, batch):
    errors = []
    compare_greedy(model, options, batch, errors)
    return max(max(e) for e in errors)


def free_running(model, options, batch):
    prompt = batch_prompt(batch)
    base, _ = greedy(model, mlx_cache.make_prompt_cache(model), prompt)
    ours, logits = greedy(model, vq.make_prompt_cache(model, **options), prompt)
    return base, ours, logits


@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3", "gemma3"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("batch", [1, 2])
def test_8bit_greedy_tokens_equal_plain_cache(name, dtype, batch):
    model = tiny_model(name, DTYPES[dtype])
    errors = []
    steps = compare_greedy(model, dict(k_bits=8, v_bits=8), batch, errors)
    worst = max(max(e) for e in errors)
    assert worst < MAX_LOGIT_ERROR, worst
    for row in range(batch):
        plain = [s[0][row] for s in steps]
        assert len(set(plain)) >= 6, "degenerate baseline: the comparison would be vacuous"
        confident = [s[2][row] for s in steps]
        assert sum(confident) > N_TOKENS // 2
        for tok_plain, tok_ours, ok in steps:
            if ok[row]:
                assert tok_ours[row] == tok_plain[row]
    # Free-running: identical tokens up to the first near tie of the plain run.
    base, ours, logits = free_running(model, dict(k_bits=8, v_bits=8), batch)
    assert logits.dtype == DTYPES[dtype]
    for row in range(batch):
        first_tie = next((i for i, s in enumerate(steps) if not s[2][row]), N_TOKENS)
        assert ours[row][: first_tie + 1] == base[row][: first_tie + 1]


def test_fetch_returns_input_dtype():
    for dtype in DTYPES.values():
        cache = vq.TurboQuantPackedCache(vq.KVCacheConfig(bit_width_inlier=4))
        k = mx.random.normal((2, 2, 5, 16)).astype(dtype)
        keys, values = cache.update_and_fetch(k, k)
        assert keys.dtype == dtype and values.dtype == dtype


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_one_bit_cache_fails_the_check(name):
    # The comparison above has teeth: a crude cache disagrees on confident steps.
    steps = compare_greedy(tiny_model(name), dict(k_bits=1, v_bits=1, center_keys=False), 1)
    assert any(ok[0] and t_ours[0] != t_plain[0] for t_plain, t_ours, ok in steps)


@pytest.mark.parametrize("name,bits", [("gemma3", 6), ("llama", 4)])
def test_lower_bits_exceed_the_logit_bound(name, bits):
    # The logit bound has teeth: measured 0.393 (gemma3, 6 bits) and 1.02 (llama, 4 bits) in these cases, every
    # token coded on arrival (code_batch=1: with the default batch the newest tokens of these short runs are exact).
    assert worst_logit_error(tiny_model(name), dict(k_bits=bits, v_bits=bits, code_batch=1), 2) > MAX_LOGIT_ERROR


def test_stream_generate_and_generate_with_prompt_cache():
    model = tiny_model("qwen3")
    tok = TokenizerWrapper(FakeTokenizer())
    plain_cache = mlx_cache.make_prompt_cache(model)
    base = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=N_TOKENS, prompt_cache=plain_cache)]
    cache = vq.make_prompt_cache(model, k_bits=8, v_bits=8)
    ours = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=N_TOKENS, prompt_cache=cache)]
    steps = compare_greedy(model, dict(k_bits=8, v_bits=8), 1)
    first_tie = next((i for i, s in enumerate(steps) if not s[2][0]), N_TOKENS)
    assert len(set(base)) >= 6 and ours[: first_tie + 1] == base[: first_tie + 1]
    assert cache[0].offset >= len(PROMPT) + N_TOKENS - 1  # generate_step runs one step ahead
    # The same cache continues a conversation through mlx_lm.generate.
    from mlx_lm import generate

    text = generate(model, tok, [5, 6, 7], max_tokens=4, prompt_cache=cache)
    assert text == generate(model, tok, [5, 6, 7], max_tokens=4, prompt_cache=plain_cache)
    assert len(text.split(">")) == 5  # 4 tokens "<i>"


def test_speculative_decoding_trims_our_caches():
    # Greedy speculative decoding must give the target model's own greedy tokens; with our caches that
    # only holds if rejected draft tokens are trimmed correctly from both models' caches. The prompt is
    # prefilled the same way for both runs (the caches fit their channel means on the first chunk). No
    # recent window here: its exact tokens are counted from the end of each chunk, so a multi-token
    # verification step sees fewer exact tokens than one-token decoding does (documented behaviour).
    # The draft is the target model itself behind a cruder cache: it agrees often, not always. code_batch=1: each
    # token coded on arrival (with a batch, its waiting tokens are exact for one-token decoding but may be coded
    # within a verification chunk, as with a recent window).
    model = tiny_model("llama")
    options, draft_options = dict(k_bits=4, v_bits=4, sink=2, code_batch=1), dict(k_bits=1, v_bits=1, code_batch=1)

    def prefilled(**opts):
        cache = vq.make_prompt_cache(model, **opts)
        model(mx.array([PROMPT[:-1]]), cache=cache)
        return cache

    last = mx.array(PROMPT[-1:])
    plain = [int(t) for t, _ in generate_step(last, model, prompt_cache=prefilled(**options), max_tokens=16)]
    cache = prefilled(**options) + prefilled(**draft_options)
    gen = speculative_generate_step(last, model, model, prompt_cache=cache, max_tokens=16, num_draft_tokens=3)
    out = [(int(t), from_draft) for t, _, from_draft in gen]
    assert [t for t, _ in out] == plain and len(set(plain)) >= 6
    assert any(d for _, d in out) and not all(d for _, d in out)  # drafts were both accepted and rejected


# -- prompt-cache files ---------------------------------------------------------------------------------
CONFIGS = {
    "plain": dict(k_bits=4, v_bits=3),
    "windows": dict(k_bits=3, v_bits=2, sink=2, recent=6, n_outlier_channels=4, outlier_bits=6),
    "prod": dict(method="turboquant_prod", k_bits=4, v_bits=4),
    "rvq_method": dict(method="turboquant_rvq", k_bits=2, v_bits=2),
    "seed_rvq": dict(kind="rvq", k_bits=2),
}


@pytest.mark.parametrize("name,config", [("llama", c) for c in CONFIGS] + [("gemma3", "windows")])
def test_save_load_continue_equals_uninterrupted(tmp_path, name, config):
    options = CONFIGS[config]
    model = tiny_model(name)
    prompt = batch_prompt(1)
    full, full_logits = greedy(model, vq.make_prompt_cache(model, **options), prompt, n=16)

    cache = vq.make_prompt_cache(model, **options)
    first, logits = greedy(model, cache, prompt, n=8)  # cache: prompt + 8 tokens; logits predict the 9th
    path = str(tmp_path / "cache.safetensors")
    vq.save_prompt_cache(path, cache, {"note": "test"})
    loaded, meta = vq.load_prompt_cache(path, return_metadata=True)
    assert meta["note"] == "test" and [type(c) for c in loaded] == [type(c) for c in cache]
    assert [c.offset for c in loaded] == [c.offset for c in cache]
    rest = []
    for _ in range(8):
        tok = mx.argmax(logits, axis=-1)
        rest.append(tok.item())
        logits = model(tok[:, None], cache=loaded)[:, -1]
    assert first[0] + rest == full[0]
    assert mx.array_equal(logits, full_logits)


def test_mlx_lm_loader_works_inside_the_context_only(tmp_path):
    model = tiny_model("llama")
    cache = vq.make_prompt_cache(model, k_bits=4, v_bits=4, recent=4)
    greedy(model, cache, batch_prompt(1), n=4)
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, cache)  # mlx_lm's own writer handles our state
    with pytest.raises(KeyError, match="TurboQuantPackedCache"):  # mlx_lm's own loader does not know our class
        mlx_cache.load_prompt_cache(path)
    with mlx_lm_cache_classes():
        loaded = mlx_cache.load_prompt_cache(path)
    assert "TurboQuantPackedCache" not in vars(mlx_cache)
    k0, v0 = cache[0]._fetch(mx.float32)
    k1, v1 = loaded[0]._fetch(mx.float32)
    assert mx.array_equal(k0, k1) and mx.array_equal(v0, v1)


# -- deepcopy and trim ------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [dict(k_bits=4), dict(k_bits=3, sink=2, recent=5), dict(kind="rvq", k_bits=2)])
def test_deepcopy_is_independent(options):
    model = tiny_model("llama")
    cache = vq.make_prompt_cache(model, **options)
    greedy(model, cache, batch_prompt(1), n=4)
    snapshot = copy.deepcopy(cache)
    offset = cache[0].offset
    step = mx.array([[3]])
    ref = model(step, cache=copy.deepcopy(snapshot))
    for _ in range(5):  # moving the original on must not reach the copy
        model(step, cache=cache)
    assert snapshot[0].offset == offset and cache[0].offset == offset + 5
    assert mx.array_equal(model(step, cache=snapshot), ref)
    assert cache[0].offset == offset + 5  # ... nor the copy's update the original


@pytest.mark.parametrize("name,options", [
    ("llama", dict(k_bits=4, v_bits=4)),
    ("llama", dict(k_bits=3, v_bits=2, sink=2, recent=6, n_outlier_channels=4)),
    ("llama", dict(kind="rvq", k_bits=2)),
    ("gemma3", dict(k_bits=4, recent=3)),
])
def test_trim_then_continue_is_consistent(name, options):
    model = tiny_model(name)
    cache = vq.make_prompt_cache(model, **options)
    prompt = mx.array([PROMPT[:5]])  # short: gemma3's windows (8) stay trimmable
    model(prompt, cache=cache)
    extra = mx.array([[9, 8]])
    before = model(extra, cache=cache)
    assert mlx_cache.can_trim_prompt_cache(cache)
    assert mlx_cache.trim_prompt_cache(cache, 2) == 2
    assert all(c.offset == 5 for c in cache)
    after = model(extra, cache=cache)
    assert mx.allclose(before, after, atol=1e-5)
    # Trimming into the prompt, then refeeding it, rebuilds the same state.
    assert mlx_cache.trim_prompt_cache(cache, 6) == 6
    model(mx.array([PROMPT[1:5]]), cache=cache)
    assert mx.allclose(model(extra, cache=cache), before, atol=1e-5)


# -- bytes ------------------------------------------------------------------------------------------
def test_nbytes_is_the_sum_of_stored_arrays():
    model = tiny_model("gemma3")
    cache = vq.make_prompt_cache(model, k_bits=3, v_bits=2, sink=2, recent=3, n_outlier_channels=4)
    greedy(model, cache, batch_prompt(2), n=6)
    for c in cache:
        r = c.rows
        stores = [r.k_codes.arrays, r.v_codes.arrays, r.sink or {}, r.tail.buffers]
        held = sum(b.nbytes for s in stores for b in s.values())
        held += sum(a.nbytes for codec in (r.k_codec, r.v_codec) for a in codec.fitted_arrays().values())
        assert c.nbytes == held
        saved = sum(v.nbytes for v in c.state.values() if isinstance(v, mx.array))
        assert c.live_nbytes == saved
        assert c.live_nbytes == stored_layout_bytes(c)


def packed_bytes(width, bits):
    """One token's codes of one head: ``width`` b-bit indices in uint32 words + a bfloat16 norm."""
    return 4 * math.ceil(width * bits / 32) + 2


def stored_layout_bytes(c, B=2, H=2, d=16, n_out=4, k_bits=3, v_bits=2, outlier_bits=8):
    """The stored layout of `test_nbytes_is_the_sum_of_stored_arrays`'s caches, counted by hand.

    Exact tokens (sink, the recent window and the trim headroom): float32 K and V. Coded tokens: keys as
    12 inlier channels at k_bits + 4 outlier channels at outlier_bits, values as 16 channels at v_bits.
    Fitted per sequence and head (each sequence fits on its own tokens, as alone): bfloat16 channel means of K and
    V, uint8 outlier channel indices.
    """
    n = c.size()
    exact = min(n, c.sink + c.recent + c.trim_headroom)  # every older token is coded
    coded = n - exact
    per_coded = packed_bytes(d - n_out, k_bits) + packed_bytes(n_out, outlier_bits) + packed_bytes(d, v_bits)
    fitted = B * H * (2 * d * 2 + n_out) if n > c.sink + c.recent else 0  # fitted once the window overflows
    return B * H * (exact * 2 * d * 4 + coded * per_coded) + fitted


# -- batch_generate ---------------------------------------------------------------------------------
def test_batch_generate_with_our_prompt_caches_continues_each_sequence():
    """Per-sequence caches from our make_prompt_cache (each already holding its prompt) merge into one batch and
    continue exactly as each sequence continued alone. (A batch cache attends only from its codes: without
    enable(model) or use_packed_attention() it refuses with a clear error.)"""
    model = tiny_model("llama")
    tok = TokenizerWrapper(FakeTokenizer())
    prompts = [PROMPT[:5], PROMPT[:9]]

    def prefilled(p):
        cache = vq.make_prompt_cache(model, k_bits=4)
        mx.eval(model(mx.array([p[:-1]]), cache=cache))
        return cache

    alone = []
    for p in prompts:
        alone.append([t for t, _ in zip((tok for tok, _ in generate_step(mx.array(p[-1:]), model,
                                                                            prompt_cache=prefilled(p))), range(4))])
    with vq.use_packed_attention():  # a batch attends only from its codes (enable(model) routes it too)
        out = batch_generate(model, tok, [p[-1:] for p in prompts], prompt_caches=[prefilled(p) for p in prompts],
                             max_tokens=4, return_token_ids=True)
    assert out.token_ids == alone
