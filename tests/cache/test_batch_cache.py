"""Batching compressed caches: `TurboQuantBatchPackedCache` against each sequence generated alone.

Two levels: the cache fed keys/values directly (bit-for-bit: the same codes, the same attention output per row,
pad tokens never coded nor attended), and tiny random mlx_lm models through mlx_lm's own batching
(``batch_generate``, ``BatchGenerator`` with sequences joining and leaving) after ``veloxquant_mlx.enable``.
Between a model run batched and alone, the model's own float32 ops may differ in the last bits (batched
matmuls), which can flip a code of a later layer: those comparisons are margin-aware.
"""
from __future__ import annotations

import copy
import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import batch_generate, stream_generate
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import gemma3_text, llama
from mlx_lm.tokenizer_utils import TokenizerWrapper

import veloxquant_mlx as vq
from fake_tokenizer import FakeTokenizer
from veloxquant_mlx import use_packed_attention
from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache
from veloxquant_mlx.options import CacheOptions
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from veloxquant_mlx.eval.specs import CONFIGURATIONS

# head_dim 32 in the tiny model: block codecs code blocks of 32 tokens
CONFIGS = {
    "affine_block-k8v4": CONFIGURATIONS["tq-affine-k8v4"],
    "affine_block-k4v4": CONFIGURATIONS["tq-affine-k4v4"],
    "lloyd_max-k4v4": CONFIGURATIONS["tq-mse-k4v4"],
    "affine-k4v4": CacheOptions(codec="affine", k_bits=4, v_bits=4, sink=4),
    "float16-nosink": CacheOptions(codec="float16", k_bits=16, v_bits=16),
    # exact recent windows: per-token codes read the tail's older tokens through a round trip; block codes wait
    "affine-recent": CacheOptions(codec="affine", k_bits=4, v_bits=4, sink=4, recent=6, trim_headroom=3),
    "affine_block-k8v4-recent": dataclasses.replace(CONFIGURATIONS["tq-affine-k8v4"], recent=8),
    # the budget presets' layout: tokens waiting for their key block exact
    "kblock_vsym8-k4v4": CONFIGURATIONS["tq-4b"],
    # issue 47's layout: tokens waiting for their key block stored as codes (provisional keys, values), the keys
    # centred on each sequence's own mean (fitted on arrival)
    "kblock_vsym8_pt-k4v4": dataclasses.replace(CONFIGURATIONS["tq-4b"], codec="kblock_vsym8_pt"),
    "kblock_vsym8_pt-k4v4-centred": dataclasses.replace(CONFIGURATIONS["tq-4b"], codec="kblock_vsym8_pt",
                                                        center_keys=True),
}
RNG = np.random.default_rng(5)
LENGTHS = (3, 80, 41, 150, 20, 7, 100, 1)  # around the sink (4) and 32-token blocks
PROMPTS = [[int(t) for t in RNG.integers(1, 96, n)] for n in LENGTHS]
STEPS = [int(t) for t in RNG.integers(1, 96, 40)]
H, D = 2, 32


def tiny(seed=0):
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, hidden_size=128,
                                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=128))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture
def batched_attention(monkeypatch):
    """Counts calls of the batch cache's attend_packed, extend and filter (joining / leaving really happened)."""
    calls = {"attend_packed": 0, "extend": 0, "filter": 0}
    for name in calls:
        original = getattr(TurboQuantBatchPackedCache, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(TurboQuantBatchPackedCache, name, counted)
    return calls


# ---------------------------------------------------------------------------------------------------------
# the cache alone: bit-for-bit against per-sequence caches
# ---------------------------------------------------------------------------------------------------------
def _stream(n, seed):
    g = np.random.default_rng(seed)
    k = g.standard_normal((1, H, n, D)).astype(np.float32) + 0.5
    v = g.standard_normal((1, H, n, D)).astype(np.float32) - 0.25
    return mx.array(k), mx.array(v)


def _states_equal(a: TurboQuantPackedCache, b: TurboQuantPackedCache) -> None:
    sa, sb = a.state, b.state
    assert sa["meta"] == sb["meta"]
    assert set(sa) == set(sb)
    for name in sa:
        if name != "meta":
            assert mx.array_equal(sa[name], sb[name]).item(), name


def _run_cache_level(options, lengths, decode_steps, pad_value=0.0, make=None):
    """Per-sequence caches (``make()``, default a TurboQuantPackedCache) and one batch cache fed the same tokens (the
    batch right-padded with ``pad_value``); returns (alone caches, batch cache, max |batch - alone| attention output
    after the prompt and at each decode step)."""
    make = make or (lambda: TurboQuantPackedCache(options))
    streams = [_stream(n + decode_steps, seed=i) for i, n in enumerate(lengths)]
    # (step 0 attends after the prompt, as a model's last prompt position would)
    alone = [make() for _ in lengths]
    batch = type(alone[0]).merge([make() for _ in lengths])
    masks = [c.make_mask(n) for c, n in zip(alone, lengths)]  # what mlx_lm gives each alone for its prompt
    T = max(lengths)
    diffs = []
    with use_packed_attention():
        for c, (k, v), n in zip(alone, streams, lengths):
            c.update_and_fetch(k[:, :, :n], v[:, :, :n])
        pad = lambda x, n: mx.concatenate([x[:, :, :n], mx.full((1, H, T - n, D), pad_value)], axis=2)  # noqa: E731
        batch.prepare(lengths=list(lengths), right_padding=[T - n for n in lengths])
        batch.update_and_fetch(mx.concatenate([pad(k, n) for (k, _), n in zip(streams, lengths)]),
                               mx.concatenate([pad(v, n) for (_, v), n in zip(streams, lengths)]))
        batch.finalize()
        # the prompt's own queries (causal within it; pad positions of shorter rows are not compared)
        qp = mx.array(np.random.default_rng(99).standard_normal((len(lengths), 2 * H, T, D)), mx.float32)
        got = batch.attend_packed(qp, D ** -0.5, "causal")
        for i, (c, n) in enumerate(zip(alone, lengths)):
            want = c.attend_packed(qp[i:i + 1, :, :n], D ** -0.5, masks[i])
            diffs.append(mx.abs(got[i:i + 1, :, :n] - want).max().item())
        for step in range(decode_steps + 1):
            if step:
                ks = [k[:, :, n + step - 1: n + step] for (k, _), n in zip(streams, lengths)]
                vs = [v[:, :, n + step - 1: n + step] for (_, v), n in zip(streams, lengths)]
                for c, k, v in zip(alone, ks, vs):
                    c.update_and_fetch(k, v)
                batch.update_and_fetch(mx.concatenate(ks), mx.concatenate(vs))
            q = mx.array(np.random.default_rng(100 + step).standard_normal((len(lengths), 2 * H, 1, D)), mx.float32)
            got = batch.attend_packed(q, D ** -0.5, None)
            want = mx.concatenate([c.attend_packed(q[i:i + 1], D ** -0.5, None) for i, c in enumerate(alone)])
            assert mx.all(mx.isfinite(got)).item()
            diffs.append(mx.abs(got - want).max().item())
    return alone, batch, diffs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batch_cache_holds_exactly_what_each_sequence_holds_alone(name):
    """Different lengths (pads at different places, rows crossing block boundaries on different steps): each row's
    codes, fitted parameters and exact windows equal its cache alone bit for bit (pad tokens never enter a block:
    the block scales see only the row's tokens), and attention per row matches."""
    options = CONFIGS[name]
    lengths = (5, 70, 33, 2, 100)
    alone, batch, diffs = _run_cache_level(options, lengths, decode_steps=40)
    assert max(diffs) < 1e-5, diffs
    assert batch.offset.tolist() == [c.offset for c in alone]
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)


@pytest.mark.parametrize("name", ["affine_block-k8v4", "lloyd_max-k4v4"])
def test_nan_in_pad_positions_changes_nothing(name):
    options = CONFIGS[name]
    lengths = (9, 70, 40)
    _, clean, d_clean = _run_cache_level(options, lengths, decode_steps=5, pad_value=0.0)
    _, dirty, d_dirty = _run_cache_level(options, lengths, decode_steps=5, pad_value=float("nan"))
    assert max(d_dirty) < 1e-5 and d_dirty == d_clean
    for i in range(len(lengths)):
        _states_equal(dirty.extract(i), clean.extract(i))
    assert all(mx.all(mx.isfinite(a)).item() for a in dirty.rows.arrays() if mx.issubdtype(a.dtype, mx.floating))


def test_filter_extend_and_extract_keep_every_row_exact():
    options = CONFIGS["affine_block-k8v4"]
    alone, batch, _ = _run_cache_level(options, (5, 70, 33, 2), decode_steps=3)
    _, other, _ = _run_cache_level(options, (40, 90), decode_steps=3)
    batch.filter([3, 1])
    batch.extend(other)
    assert batch.offset.tolist() == [alone[3].offset, alone[1].offset, 43, 93]
    _states_equal(batch.extract(0), alone[3])
    _states_equal(batch.extract(1), alone[1])
    _states_equal(batch.extract(3), other.extract(1))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_take_rows_is_the_same_with_the_compiled_gather_or_mx_take(name):
    """`take_rows` (extract / filter) gathers every array in one compiled operation where it runs; with the kernel
    off it takes each with ``mx.take``: the same arrays, rows, dtypes and shapes."""
    from veloxquant_mlx.attention import kernel
    from veloxquant_mlx.cache.rows import take_rows

    _, batch, _ = _run_cache_level(CONFIGS[name], (5, 70, 33, 2), decode_steps=3)
    for idx in ([2], [3, 0], [1, 2, 3]):
        on = take_rows(batch.rows, idx)
        previous = kernel.set_enabled(False)
        try:
            off = take_rows(batch.rows, idx)
        finally:
            kernel.set_enabled(previous)
        a, b = on.arrays(), off.arrays()
        assert len(a) == len(b) > 0
        assert all(x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y, equal_nan=True).item()
                   for x, y in zip(a, b)), idx


def test_gather_rows_against_mx_take():
    """The compiled gather of rows (strided views, folded items, any dtype, empty axes, a broadcast array) equals
    ``mx.take``; a row out of range or a fold that does not divide the rows is a ValueError naming the array."""
    from veloxquant_mlx.attention import kernel

    mod = kernel.compiled_module()
    assert mod is not None and hasattr(mod, "gather_rows"), kernel.status()[1]
    a = mx.random.normal((5, 3, 40, 8), key=mx.random.key(1))
    words = (mx.random.uniform(shape=(5, 3, 8, 20), key=mx.random.key(2)) * 4e9).astype(mx.uint32)
    folded = mx.random.normal((15, 8), key=mx.random.key(3)).astype(mx.float16)
    arrays = [a, a[:, :, 10:30], mx.swapaxes(a, 2, 3), words[..., :12], folded, mx.arange(5), a[:, :, :0],
              mx.broadcast_to(folded[:1], (15, 8)), (a > 0)]
    folds = [1, 1, 1, 1, 3, 1, 1, 3, 1]
    for rows in ([3], [0, 4, 2], [1, 1], []):
        got = kernel.gather_rows(arrays, rows, folds)
        previous = kernel.set_enabled(False)
        try:
            want = kernel.gather_rows(arrays, rows, folds)
        finally:
            kernel.set_enabled(previous)
        for arr, f, g, w in zip(arrays, folds, got, want):
            ref = mx.take(arr, mx.array([r * f + j for r in rows for j in range(f)], dtype=mx.int32), axis=0)
            for out in (g, w):
                assert out.shape == ref.shape and out.dtype == ref.dtype and mx.array_equal(out, ref).item(), (rows, f)
    with pytest.raises(ValueError, match="out of range for array 0"):
        mod.gather_rows([a], [5], [1])
    with pytest.raises(ValueError, match="array 0 does not hold whole items"):
        mod.gather_rows([a], [0], [2])


def _join_cases():
    for name in sorted(CONFIGS):
        yield pytest.param(name, None, id=name)
    for name in ("affine-k4v4", "float16-nosink"):
        yield pytest.param(name, 24, id=f"{name}-window24")


@pytest.mark.parametrize("name, window", list(_join_cases()))
def test_extend_concatenates_rows_as_a_re_merge_would(name, window):
    """`extend` joins two decoding batches by concatenating their arrays (stores padded to the larger one's slots,
    tails right-aligned): every row then holds what merging all rows' per-sequence caches gives, and attention
    over the next decode steps is the same."""

    options = CONFIGS[name]
    make = None if window is None else (lambda: TurboQuantRotatingPackedCache(options, max_size=window,
                                                                             keep=options.sink))
    _, a, _ = _run_cache_level(options, (5, 70, 2), decode_steps=3, make=make)
    _, b, _ = _run_cache_level(options, (90, 33), decode_steps=1, make=make)
    merged = type(a).merge([c.extract(i) for c in (a, b) for i in range(c.B)])
    joined = copy.deepcopy(a)
    joined.extend(copy.deepcopy(b))
    assert joined.B == merged.B == 5 and joined.offset.tolist() == merged.offset.tolist()
    for i in range(5):
        _states_equal(joined.extract(i), merged.extract(i))
    assert joined.nbytes == _arrays_reachable(joined)
    g = np.random.default_rng(3)
    with use_packed_attention():
        for step in range(70):  # crosses a 64-token block for every row
            k, v = (mx.array(g.standard_normal((5, H, 1, D)), mx.float32) for _ in range(2))
            q = mx.array(g.standard_normal((5, 2 * H, 1, D)), mx.float32)
            outs = []
            for c in (joined, merged):
                c.update_and_fetch(k, v)
                outs.append(c.attend_packed(q, D ** -0.5, None))
            assert mx.abs(outs[0] - outs[1]).max().item() < 1e-5, step
    for i in range(5):
        _states_equal(joined.extract(i), merged.extract(i))
    emptied = copy.deepcopy(a)
    emptied.filter([])  # every sequence finished: no rows, old arrays still held
    emptied.extend(copy.deepcopy(b))
    assert emptied.B == 2
    for i in range(2):
        _states_equal(emptied.extract(i), b.extract(i))


def _arrays_reachable(obj, seen=None) -> int:
    """Bytes of every distinct mx.array reachable from ``obj``'s attributes (an independent count)."""
    seen = set() if seen is None else seen
    if isinstance(obj, mx.array):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_arrays_reachable(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_arrays_reachable(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type) and id(obj) not in seen:
        seen.add(id(obj))
        # shared, stateless rotations (the same for every row); the (B,) offset array is bookkeeping, as in
        # mlx_lm's BatchKVCache, whose nbytes counts keys and values only; "_views" (with the attention parts
        # made of them) / "_sink_views" are views of counted arrays kept for the next decode step (reset whenever
        # those arrays change: a stale one would attend old codes, which tests/cache/test_kernel.py and the equality
        # tests here would see; holding superseded arrays, tests/cache/test_cache_memory.py)
        skip = ("rotation", "quantizers", "_base", "offset", "_views", "_sink_views")
        return sum(_arrays_reachable(v, seen) for k, v in vars(obj).items() if k not in skip)
    return 0


@pytest.mark.parametrize("name", ["affine_block-k8v4", "lloyd_max-k4v4"])
def test_nbytes_counts_every_stored_array(name):
    lengths = (50, 300, 180)
    _, batch, _ = _run_cache_level(CONFIGS[name], lengths, decode_steps=3)
    assert batch.nbytes == _arrays_reachable(batch) > 0
    plain = 2 * len(lengths) * H * (max(lengths) + 3) * D * 4  # mlx_lm's BatchKVCache, float32, left-padded
    assert batch.nbytes < plain / 2.5


@pytest.mark.parametrize("name", ["affine-k4v4", "float16-nosink"])
def test_sliding_window_batch_evicts_per_sequence(name):
    """Windows of 24 tokens: rows of different lengths fill and evict on different steps; every row's window
    (codes, fitted parameters, sink) and attention equal its TurboQuantRotatingPackedCache alone."""
    options = CONFIGS[name]
    make = lambda: TurboQuantRotatingPackedCache(options, max_size=24, keep=options.sink)  # noqa: E731
    lengths = (5, 40, 20, 2, 23)
    alone, batch, diffs = _run_cache_level(options, lengths, decode_steps=30, make=make)
    assert type(batch).__name__ == "TurboQuantBatchRotatingPackedCache"
    assert max(diffs) < 1e-5, diffs
    assert [c.size() for c in alone] == [24] * len(lengths)  # every row's window is full and has evicted
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)
    assert batch.nbytes == _arrays_reachable(batch)


def test_sliding_window_batch_drops_evicted_slots():
    options = CONFIGS["affine-k4v4"]
    make = lambda: TurboQuantRotatingPackedCache(options, max_size=16, keep=4)  # noqa: E731
    alone, batch, diffs = _run_cache_level(options, (3, 30), decode_steps=600, make=make)
    assert max(diffs) < 1e-5
    # 633 tokens seen; evicted slots are dropped a step (256) at a time, so at most the window + 255 slots are held
    # (kept, they would need 768): for the batch and for each sequence alone
    assert batch.rows.k_codes.capacity <= 2 * 256
    assert all(c.rows.k_codes.capacity <= 2 * 256 for c in alone)
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)


# -- everything a single cache accepts, a batch accepts: sink != keep, trim, exact recent windows -------------------
def _decode_both(alone, batch, steps: int, seed: int) -> float:
    """Both go on decoding the same tokens; the largest attention difference per row."""
    g, worst = np.random.default_rng(seed), 0.0
    with use_packed_attention():
        for _ in range(steps):
            k, v = (mx.array(g.standard_normal((len(alone), H, 1, D)), mx.float32) for _ in range(2))
            q = mx.array(g.standard_normal((len(alone), 2 * H, 1, D)), mx.float32)
            for i, c in enumerate(alone):
                c.update_and_fetch(k[i:i + 1], v[i:i + 1])
            batch.update_and_fetch(k, v)
            got = batch.attend_packed(q, D ** -0.5, None)
            want = mx.concatenate([c.attend_packed(q[i:i + 1], D ** -0.5, None) for i, c in enumerate(alone)])
            worst = max(worst, mx.abs(got - want).max().item())
    return worst


@pytest.mark.parametrize("sink, keep, recent", [(2, 4, 0), (0, 3, 0), (1, 4, 5)])
def test_sliding_window_batch_with_sink_other_than_keep(sink, keep, recent):
    """A window keeps its ``keep`` first tokens, of which only ``sink`` are exact: the others are codes the window
    never evicts (each row skips its own evicted codes after them). Rows equal their caches alone, bit for bit."""
    options = dataclasses.replace(CONFIGS["affine-k4v4"], sink=sink, recent=recent)
    make = lambda: TurboQuantRotatingPackedCache(options, max_size=24, keep=keep)  # noqa: E731
    lengths = (5, 40, 20, 2, 23)
    alone, batch, diffs = _run_cache_level(options, lengths, decode_steps=30, make=make)
    assert max(diffs) < 1e-5, diffs
    assert [c.size() for c in alone] == [24] * len(lengths)  # every row's window is full and has evicted
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)
    assert batch.nbytes == _arrays_reachable(batch)
    assert _decode_both(alone, batch, 300, seed=7) < 1e-5  # past a dropped step of evicted slots
    assert batch.rows.k_codes.capacity <= 24 + 2 * 256
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)


@pytest.mark.parametrize("name", ["affine_block-k8v4", "lloyd_max-k4v4", "affine-recent", "affine_block-k8v4-recent"])
def test_batch_trim_equals_each_sequence_trimmed(name):
    """``trim(n)`` (speculative decoding's rejected drafts) drops every row's ``n`` newest tokens exactly as each
    sequence alone does (a cut block's survivors back in the tail), and the rows go on decoding as alone."""
    options = CONFIGS[name]
    alone, batch, _ = _run_cache_level(options, (5, 70, 33, 2), decode_steps=3)
    for n in (1, 5, 40):
        assert batch.is_trimmable() and batch.trim(n) == n
        for c in alone:
            c.trim(n)
        assert batch.offset.tolist() == [c.offset for c in alone]
        for i, c in enumerate(alone):
            _states_equal(batch.extract(i), c)
        assert _decode_both(alone, batch, 3, seed=n) < 1e-5
    assert _decode_both(alone, batch, 70, seed=1) < 1e-5  # codes whole blocks again after the trims
    for i, c in enumerate(alone):
        _states_equal(batch.extract(i), c)


def test_a_chunk_query_without_a_stored_chunk_is_refused_clearly():
    """Queries of several tokens attend the chunk just stored; a freshly merged batch (holding restored tokens) has
    none: a ValueError naming the queries, not a TypeError from unpacking nothing."""
    options = CONFIGS["affine_block-k8v4"]
    alone = []
    with use_packed_attention():
        for i, n in enumerate((30, 90)):
            c = TurboQuantPackedCache(options)
            c.update_and_fetch(*_stream(n, seed=i))
            alone.append(c)
        batch = TurboQuantPackedCache.merge(alone)
        q = mx.zeros((2, 2 * H, 3, D))
        with pytest.raises(ValueError, match="queries of L=3"):
            batch.attend_packed(q, D ** -0.5, "causal")
        assert batch.attend_packed(q[:, :, :1], D ** -0.5, None).shape == (2, 2 * H, 1, D)


def test_refusals_are_clear():
    with pytest.raises(ValueError, match="options"):
        TurboQuantPackedCache.merge([TurboQuantPackedCache(k_bits=4), TurboQuantPackedCache(k_bits=3)])
    with pytest.warns(UserWarning, match="uncompressed while batched"):  # caches built to decode (MLA models)
        assert type(TurboQuantPackedCache.merge([TurboQuantPackedCache(fetch_placeholders=False)])).__name__ == \
            "BatchKVCache"
    with pytest.raises(ValueError, match="caches"):
        TurboQuantBatchPackedCache.merge([])
    _, batch, _ = _run_cache_level(CONFIGS["affine-k4v4"], (3, 9), decode_steps=1)
    with pytest.raises(ValueError, match="batch_indices"):
        batch.filter([0, 2])
    with pytest.raises(ValueError, match="idx"):
        batch.extract(5)
    with pytest.raises(ValueError, match="window_size"):
        batch.make_mask(1, window_size=0)
    with pytest.raises(ValueError, match="enable"):  # attention on codes only
        batch.update_and_fetch(mx.zeros((2, H, 1, D)), mx.zeros((2, H, 1, D)))
    with use_packed_attention(), pytest.raises(ValueError, match="batch size"):
        batch.update_and_fetch(mx.zeros((3, H, 1, D)), mx.zeros((3, H, 1, D)))


# ---------------------------------------------------------------------------------------------------------
# a tiny model, batched by hand as mlx_lm's BatchGenerator does, and through mlx_lm's own entry points
# ---------------------------------------------------------------------------------------------------------
def _alone_logits(model, prompt, steps):
    caches = mlx_cache.make_prompt_cache(model)
    if len(prompt) > 1:
        model(mx.array([prompt[:-1]]), cache=caches)
    out = [model(mx.array([prompt[-1:]]), cache=caches)[0, -1]]
    out += [model(mx.array([[t]]), cache=caches)[0, -1] for t in steps]
    return np.array(mx.stack(out)), caches


def _batched_logits(model, prompts, steps):
    """What ``BatchGenerator`` does: merge fresh caches, right-padded prompt with prepare / finalize, then decode."""
    per_sequence = [mlx_cache.make_prompt_cache(model) for _ in prompts]
    caches = [type(layer[0]).merge(list(layer)) for layer in zip(*per_sequence)]
    n = [len(p) - 1 for p in prompts]
    T = max(n)
    if T:
        for c in caches:
            c.prepare(lengths=n, right_padding=[T - x for x in n])
        model(mx.array([p[:-1] + [0] * (T - len(p) + 1) for p in prompts]), cache=caches)
        for c in caches:
            c.finalize()
    out = [model(mx.array([p[-1:] for p in prompts]), cache=caches)[:, -1]]
    out += [model(mx.array([[t]] * len(prompts)), cache=caches)[:, -1] for t in steps]
    return np.array(mx.stack(out, axis=1)), caches


def _assert_same_greedy(alone, batched, tol):
    """Logits within ``tol``; the greedy token equal wherever alone's top-2 margin exceeds twice the difference."""
    diff = np.abs(alone - batched).max(axis=-1)
    assert diff.max() < tol, diff.max()
    top2 = np.sort(alone, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * diff + 1e-6
    assert clear.mean() > 0.9
    assert (alone.argmax(-1) == batched.argmax(-1))[clear].all()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("size", [1, 3, 8])
def test_batched_greedy_equals_each_prompt_alone(model, name, size, batched_attention):
    vq.enable(model, CONFIGS[name])
    try:
        prompts = PROMPTS[:size]
        got, caches = _batched_logits(model, prompts, STEPS)
        assert all(type(c) is TurboQuantBatchPackedCache for c in caches)
        for i, p in enumerate(prompts):
            want, _ = _alone_logits(model, p, STEPS)
            _assert_same_greedy(want, got[i], tol=1e-2)
    finally:
        vq.disable(model)
    assert batched_attention["attend_packed"] > 0


def test_sliding_window_model_batched_equals_each_prompt_alone(batched_attention):
    """gemma3 (sliding-window layers of 16 tokens between full-attention ones): windows fill and evict per row.

    This tiny gemma3 is touchy: with OpenBLAS a batched matmul differs from a single one by ~1e-5 (plain caches
    too), enough to flip an 8-bit key code of the first layer (measured: logits 0.05 apart for one row, 2e-6 with
    MLX's own BLAS); the cache-level tests above show the rows are exact."""
    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", num_hidden_layers=3, head_dim=32, sliding_window=16, sliding_window_pattern=3,
        query_pre_attn_scalar=32, hidden_size=128, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128))
    mx.eval(model.parameters())
    vq.enable(model)
    try:
        prompts = [PROMPTS[i] for i in (0, 2, 4, 5, 6)]
        got, caches = _batched_logits(model, prompts, STEPS[:30])
        assert {type(c).__name__ for c in caches} == {"TurboQuantBatchPackedCache",
                                                      "TurboQuantBatchRotatingPackedCache"}
        for i, p in enumerate(prompts):
            want, _ = _alone_logits(model, p, STEPS[:30])
            _assert_same_greedy(want, got[i], tol=0.1)
    finally:
        vq.disable(model)
    assert batched_attention["attend_packed"] > 0


def test_extract_then_continue_alone_equals_batched_continuation(model):
    vq.enable(model, CONFIGS["affine_block-k8v4"])
    try:
        prompts = PROMPTS[:4]
        _, caches = _batched_logits(model, prompts, STEPS[:10])
        extracted = [[c.extract(i) for c in caches] for i in range(len(prompts))]
        assert all(type(c) is TurboQuantPackedCache for row in extracted for c in row)
        more = STEPS[10:20]
        batched = np.array(mx.stack([model(mx.array([[t]] * len(prompts)), cache=caches)[:, -1] for t in more], 1))
        for i, row in enumerate(extracted):
            alone = np.array(mx.stack([model(mx.array([[t]]), cache=row)[0, -1] for t in more]))
            np.testing.assert_allclose(alone, batched[i], atol=1e-4, rtol=1e-4)
            assert [c.offset for c in row] == [len(prompts[i]) + 20] * len(row)
    finally:
        vq.disable(model)


def _alone_tokens(model, tok, prompt, max_tokens):
    out = list(stream_generate(model, tok, prompt, max_tokens=max_tokens))
    return [r.token for r in out], np.array(mx.stack([r.logprobs for r in out]))


class _WindowedLlama(llama.Model):
    """A tiny llama whose layers are 24-token windows keeping their first 4 tokens (mlx_lm's ``max_kv_size``
    layout), so a configuration with ``sink`` < 4 gives windows whose sink differs from keep."""

    def make_cache(self):
        return [mlx_cache.RotatingKVCache(max_size=24, keep=4) for _ in self.layers]


def _windowed_model():
    mx.random.seed(0)
    m = _WindowedLlama(llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, hidden_size=128,
                                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                       vocab_size=128))
    mx.eval(m.parameters())
    return m


@pytest.mark.parametrize("case", ["default", "affine-recent", "window-sink2-keep4"])
def test_batch_generator_with_sequences_joining_and_leaving(model, batched_attention, case):
    """mlx_lm's own BatchGenerator (prefill in chunks of two, joins while others decode, finished rows leave):
    every sequence gets the tokens it gets alone, with the default configuration, exact recent windows, and
    sliding windows whose sink (2) differs from keep (4)."""
    tok = TokenizerWrapper(FakeTokenizer())
    config = {"default": None, "affine-recent": CONFIGS["affine-recent"],
              "window-sink2-keep4": dataclasses.replace(CONFIGS["affine-k4v4"], sink=2)}[case]
    single = TurboQuantRotatingPackedCache if case.startswith("window") else TurboQuantPackedCache
    if case.startswith("window"):
        model = _windowed_model()
    vq.enable(model, config)
    try:
        first, later = [(PROMPTS[1], 12), (PROMPTS[4], 30)], [(PROMPTS[3], 20), (PROMPTS[0], 6), (PROMPTS[6], 9)]
        gen = BatchGenerator(model, max_tokens=30, completion_batch_size=8, prefill_batch_size=2)
        uids = gen.insert([p for p, _ in first], [m for _, m in first])
        got, logprobs, finished = {}, {}, {}
        rounds = 0
        while responses := gen.next_generated():
            for r in responses:
                got.setdefault(r.uid, []).append(r.token)
                logprobs.setdefault(r.uid, []).append(np.array(r.logprobs))
                if r.finish_reason is not None:
                    finished[r.uid] = r.prompt_cache
            rounds += 1
            if rounds == 4:  # join while the first two are decoding
                uids += gen.insert([p for p, _ in later], [m for _, m in later])
        gen.close()
        for uid, (p, m) in zip(uids, first + later):
            tokens, lp = _alone_tokens(model, tok, p, m)
            assert len(got[uid]) == m
            _assert_same_greedy(lp, np.stack(logprobs[uid]), tol=1e-2)
            assert got[uid] == tokens
            assert all(type(c) is single for c in finished[uid]), finished[uid]
            # the last token was fed (the next step runs ahead)
            assert [c.offset for c in finished[uid]] == [len(p) + m] * 2, (len(p), m)
            if case.startswith("window"):
                assert all((c.sink, c.keep) == (2, 4) for c in finished[uid])
    finally:
        vq.disable(model)
    assert batched_attention["attend_packed"] and batched_attention["extend"] and batched_attention["filter"]


def test_batch_generate_after_enable(model, batched_attention):
    tok = TokenizerWrapper(FakeTokenizer())
    prompts = PROMPTS[:6]
    vq.enable(model)
    try:
        out = batch_generate(model, tok, prompts, max_tokens=8, return_token_ids=True, return_prompt_caches=True)
        for p, ids, caches in zip(prompts, out.token_ids, out.caches):
            tokens, _ = _alone_tokens(model, tok, p, 8)
            assert ids == tokens
            assert all(type(c) is TurboQuantPackedCache for c in caches)
        # the returned per-sequence caches merge back (prompt-cache reuse): continuing them batched works
        again = batch_generate(model, tok, [[5]] * len(prompts), prompt_caches=out.caches, max_tokens=2,
                               return_token_ids=True)
        assert all(len(ids) == 2 for ids in again.token_ids)
    finally:
        vq.disable(model)
    assert batched_attention["attend_packed"] > 0


def test_left_padded_prompt_equals_each_sequence_alone():
    """``prepare(left_padding=...)`` (mlx_lm's BatchKVCache protocol for an empty batch): pad tokens first."""
    options, lengths = CONFIGS["affine_block-k8v4"], (7, 70, 36)
    T = max(lengths)
    streams = [_stream(n, seed=i) for i, n in enumerate(lengths)]
    alone = [TurboQuantPackedCache(options) for _ in lengths]
    batch = TurboQuantPackedCache.merge([TurboQuantPackedCache(options) for _ in lengths])
    batch.prepare(left_padding=[T - n for n in lengths])
    assert batch.offset.tolist() == [n - T for n in lengths]  # RoPE puts each row's first real token at 0
    pad = lambda x: mx.concatenate([mx.full((1, H, T - x.shape[2], D), float("nan")), x], axis=2)  # noqa: E731
    with use_packed_attention():
        for c, (k, v) in zip(alone, streams):
            c.update_and_fetch(k, v)
        batch.update_and_fetch(mx.concatenate([pad(k) for k, _ in streams]), mx.concatenate([pad(v) for _, v in streams]))
        batch.finalize()
        q = mx.array(np.random.default_rng(0).standard_normal((3, 2 * H, T, D)), mx.float32)
        got = batch.attend_packed(q, D ** -0.5, "causal")
        for i, (c, n) in enumerate(zip(alone, lengths)):
            assert mx.array_equal(got[i:i + 1, :, T - n:], c.attend_packed(q[i:i + 1, :, T - n:], D ** -0.5, "causal")).item()
            assert not mx.any(got[i, :, :T - n]).item()  # pad queries: zeros, not NaN
            _states_equal(batch.extract(i), c)
    assert batch.offset.tolist() == list(lengths)


# ---------------------------------------------------------------------------------------------------------
# `veloxquant generate` with several prompts (batched through mlx_lm's BatchGenerator)
# ---------------------------------------------------------------------------------------------------------
def test_generate_command_needs_a_prompt_and_a_readable_prompts_file(capsys, tmp_path):
    from veloxquant_mlx.cli import main

    assert main(["generate"]) != 0 and "--prompt" in capsys.readouterr().err
    assert main(["generate", "--prompts-file", str(tmp_path / "none.txt")]) != 0
    assert "--prompts-file" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n  \n")
    assert main(["generate", "--prompts-file", str(tmp_path / "empty.txt")]) != 0
    assert "holds no prompt" in capsys.readouterr().err


@pytest.mark.model
def test_generate_command_batches_several_prompts(smollm2, capsys, tmp_path, batched_attention):
    from veloxquant_mlx.cli import main

    (tmp_path / "prompts.txt").write_text("What is the capital of Japan?\n\nWhat is the capital of France?\n")
    rc = main(["generate", "--prompt", "What is the capital of France?", "--prompts-file", str(tmp_path / "prompts.txt"),
               "--method", "tq-affine-k8v4", "--max-tokens", "8"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    answers = dict(line.split("] ", 1) for line in out.out.splitlines() if line.startswith("["))
    assert "Paris" in answers["[1"] and "Tokyo" in answers["[2"] and answers["[3"] == answers["[1"], answers
    assert "3 prompts batched" in out.err
    assert batched_attention["attend_packed"] >= len(smollm2[0].layers) * 7
    rc = main(["generate", "--prompt", "a", "--prompt", "b", "--method", "mlx-q4"])  # mlx_lm's 4-bit cannot batch
    assert rc != 0 and "cannot batch several prompts" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["affine_block-k8v4", "lloyd_max-k4v4"])
def test_a_configuration_first_used_in_one_thread_works_in_another(name):
    """mlx_lm.server generates in its own thread, after the main thread built (and used) caches of the same
    configuration: MLX arrays belong to the stream of the thread that made them, so nothing made in one thread may
    be handed to another (it failed: "There is no Stream(cpu, 0) in current thread", the server's generation died)."""
    import threading

    options = CONFIGS[name]
    here = TurboQuantPackedCache.merge([TurboQuantPackedCache(options), TurboQuantPackedCache(options)])
    with use_packed_attention():
        here.update_and_fetch(*(mx.zeros((2, H, 3, D)) for _ in range(2)))
    errors = []

    def generation_thread():
        try:
            with use_packed_attention():
                rows = [TurboQuantPackedCache(options) for _ in range(2)]
                rows[0].update_and_fetch(*_stream(70, seed=1))
                batch = TurboQuantPackedCache.merge(rows)
                batch.update_and_fetch(*(mx.zeros((2, H, 1, D)) for _ in range(2)))
                mx.eval([v for v in batch.state.values() if isinstance(v, mx.array)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=generation_thread)
    t.start()
    t.join()
    assert not errors, errors


def test_a_decoding_batch_keeps_its_exact_tail_bounded():
    """Rows code their blocks on different steps; the tail slots that are padding in every row are dropped a code
    step at a time (not at every coded block: one copy of the whole tail each), so the tail never holds more
    than each row's waiting tokens plus less than one step of padding, and attention is unchanged by it."""
    from veloxquant_mlx.cache.rows import TAIL_STEP

    options = CONFIGS["affine_block-k8v4"]
    alone, batch, diffs = _run_cache_level(options, (5, 61, 30), decode_steps=0)
    rows = batch.rows
    bound = rows.exact_keep + 2 * rows.code_step + TAIL_STEP  # (waiting < keep + step, padding < step, growth)
    rng = np.random.default_rng(3)
    with use_packed_attention():
        for t in range(200):
            k = mx.array(rng.standard_normal((3, H, 1, D)), mx.float32)
            batch.update_and_fetch(k, k)
            for c, i in zip(alone, range(3)):
                c.update_and_fetch(k[i:i + 1], k[i:i + 1])
            q = mx.array(rng.standard_normal((3, 2 * H, 1, D)), mx.float32)
            got = batch.attend_packed(q, D ** -0.5, None)
            want = mx.concatenate([c.attend_packed(q[i:i + 1], D ** -0.5, None) for i, c in enumerate(alone)])
            assert mx.abs(got - want).max().item() < 1e-5, t
            assert rows.tail.capacity <= bound, (t, rows.tail.length, rows.tail_n)
