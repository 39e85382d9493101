"""One bits measurement shared by the evaluation and `veloxquant methods` (veloxquant_mlx.apps.eval.memory), the
budget names registered as methods (apps.eval.specs), the second evaluation corpus (apps.eval.corpus), and the budget
layouts' codes (veloxquant_mlx.codecs: affine_sym, affine_block_kv, affine_sym_log). The budget presets' bits
themselves: tests/cache/test_presets_budgets.py."""
from __future__ import annotations

import pytest

from veloxquant_mlx.apps.eval import corpus as corpus_mod
from veloxquant_mlx.apps.eval import perplexity_eval
from veloxquant_mlx.apps.eval.memory import cache_memory, measure_bits, measure_bytes_per_token, model_kv_shape
from veloxquant_mlx.apps.eval.specs import BUDGET_CONFIGURATIONS, CONFIGURATIONS, resolve_spec


def test_budget_names_are_registered_and_usable_as_methods():
    assert set(BUDGET_CONFIGURATIONS) == {"tq-4b", "tq-3b", "tq-2b"}
    for name in BUDGET_CONFIGURATIONS:
        assert resolve_spec(name).options is CONFIGURATIONS[name]


def test_one_bits_measurement_for_the_evaluation_and_methods(tiny_model, random_tokens):
    """`perplexity_eval`'s bits (the caches after the window) equal `measure_bytes_per_token`'s and `measure_bits`'
    (random data, what `veloxquant methods`, the server and the benchmarks print) at the same context, for blocked
    and per-token layouts, with and without exact sink tokens."""
    _, kv_heads, head_dim = model_kv_shape(tiny_model)
    for name in ("kv", "mlx-q4", "tq-affine-k4v4", "tq-mse-k3v3", "tq-4b"):
        s = resolve_spec(name)
        m = measure_bytes_per_token(s.make_cache, kv_heads, head_dim, model=tiny_model, context=512)
        assert m["sink"] == (s.options.sink if s.options is not None else 0)
        r = perplexity_eval(tiny_model, random_tokens, [s], context=512, chunk=256, progress=False)
        assert r[s.name]["memory"]["bits_per_coordinate"] == pytest.approx(m["bits_per_coordinate"], rel=1e-12), name
        b = measure_bits(s.make_cache, kv_heads, head_dim, model=tiny_model, lengths=(512,))
        assert b["bits"][512] == pytest.approx(m["bits_per_coordinate"], rel=1e-12), name


def test_bits_count_the_exact_tokens_a_blocked_cache_holds():
    """A sink of 4 tokens and 8 tokens of trim headroom keep a 64-token block cache off its blocks: the exact tokens
    it holds at 2048 (float32 here) are counted, with the codes' scales and the fitted means."""
    import mlx.core as mx

    spec = resolve_spec("tq-affine-k4v4")
    m = measure_bytes_per_token(spec.make_cache, 3, 64, context=2048)
    cache = spec.make_cache(_Stub(3))[0]
    x = mx.random.normal((1, 3, 2048, 64))
    cache.update_and_fetch(x, x)
    n_exact = cache.rows.sink_n[0] + cache.rows.tail_n[0]
    assert m["sink"] == 4 and n_exact > 8 and cache.n_coded + n_exact == 2048
    fitted = 2 * 3 * 64 * 4 * 8  # per-head float32 means of keys and values, in bits
    expected = (cache.n_coded * (4 + 0.5) + n_exact * 32 + fitted / (3 * 2 * 64)) / 2048
    assert m["bits_per_coordinate"] == pytest.approx(expected, rel=1e-9)


def test_measure_context_is_checked():
    with pytest.raises(ValueError, match="context"):
        measure_bytes_per_token(resolve_spec("kv").make_cache, 1, 64, context=256)
    with pytest.raises(ValueError, match="length"):
        measure_bits(resolve_spec("kv").make_cache, 1, 64, lengths=(0, 512))


def test_measure_bits_follows_the_evaluation_chunks():
    """`measure_bits`' average over a window's positions: each chunk's positions weigh the bits held after it."""
    spec = resolve_spec("tq-4b")
    m = measure_bits(spec.make_cache, 3, 64, lengths=(600,), chunk=256)
    after = {n: measure_bytes_per_token(spec.make_cache, 3, 64, context=n)["bits_per_coordinate"]
             for n in (512, 600)}
    first = measure_bits(spec.make_cache, 3, 64, lengths=(256,))["bits"][256]
    expected = (256 * first + 256 * after[512] + 88 * after[600]) / 600
    assert m["kl_average_bits"][600] == pytest.approx(expected, rel=1e-9)
    assert m["bits"][600] == pytest.approx(after[600], rel=1e-12)
    assert m["max_bits"][600] == pytest.approx(max(first, after[512], after[600]), rel=1e-12)


def test_cache_memory_is_stored_bytes_not_capacity():
    """Our caches grow in steps; the figure is their live arrays (as a saved file), mlx_lm's at multiples of 256."""
    import mlx.core as mx

    cache = resolve_spec("tq-mse-k4v4").make_cache(_Stub(1))[0]
    x = mx.random.normal((1, 1, 300, 64))
    cache.update_and_fetch(x, x)
    assert cache.nbytes > cache.live_nbytes
    assert cache_memory([cache], 300, 1, 64)["bytes_total"] == cache.live_nbytes


class _Stub:
    """One layer of ``kv_heads`` heads of dim 64, as much of a model as a cache factory reads."""

    def __init__(self, kv_heads: int):
        from types import SimpleNamespace

        self.layers = [None]
        self.args = SimpleNamespace(num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=64,
                                    hidden_size=64 * kv_heads)


# ----------------------------------------------------------------------------- corpora
LISTING = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void.

Genesis 2

  1 Thus the heavens and the earth were finished.
"""


def test_kjv_listing_becomes_one_paragraph_per_chapter():
    assert corpus_mod.kjv_paragraphs(LISTING) == [
        "In the beginning God created the heaven and the earth. And the earth was without form, and void.",
        "Thus the heavens and the earth were finished.",
    ]


def test_missing_kjv_says_how_to_install():
    with pytest.raises(corpus_mod.CorpusMissing, match="apt-get install bible-kjv"):
        corpus_mod.kjv_text(program="no-such-bible-program")


def test_unknown_corpus_names_the_choices():
    with pytest.raises(ValueError, match="corpus must be one of .*kjv"):
        corpus_mod.corpus_text("gutenberg")


@pytest.mark.skipif(corpus_mod.shutil.which(corpus_mod.KJV_PROGRAM) is None, reason="bible-kjv not installed")
def test_kjv_corpus_is_long_narrative_and_deterministic():
    text = corpus_mod.kjv_text()
    assert text.startswith("In the beginning God created the heaven and the earth.")
    assert len(text.split()) > 100_000  # about 145k words: > 30k tokens by far
    assert "Genesis" not in text.split("\n\n")[0][:20] and not any(ch.isdigit() for ch in text[:500])
    assert corpus_mod.kjv_text() == text


# ----------------------------------------------------------------------------- the budget layouts' codes
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packed_codes_are_mlx_affine_codes(bits):
    """`pack_codes` writes MLX's own layout: mx.dequantize with scale 1 and bias 0 reads the integers back."""
    import mlx.core as mx
    import numpy as np

    from veloxquant_mlx.codecs.affine_sym import pack_codes

    q = mx.array(np.random.default_rng(bits).integers(0, 2 ** bits, (2, 3, 64)))
    w = pack_codes(q, bits)
    assert w.dtype == mx.uint32 and w.shape == (2, 3, 64 * bits // 32)
    ones = mx.ones((2, 3, 1))
    back = mx.dequantize(w, ones, mx.zeros_like(ones), group_size=64, bits=bits)
    assert bool(mx.array_equal(back, q.astype(back.dtype)))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_clipped_codes_lose_less_than_min_max(bits):
    """Least-squared-error clipping never loses to plain min-max (1.0 is a candidate) and gains at low bits."""
    import mlx.core as mx

    from veloxquant_mlx.cache.options import CacheOptions
    from veloxquant_mlx.codecs import CODECS

    x = mx.random.normal((1, 3, 256, 64), key=mx.random.key(bits))

    def err(codec, role, group_size=128):
        opts = CacheOptions(codec=codec, k_bits=bits, v_bits=bits, group_size=group_size, center_keys=False,
                            center_values=False)
        layout = CODECS[codec]
        c = (layout.keys if role == "keys" else layout.values).from_options(opts, role, 64)
        c.fit(x)
        return float(mx.mean(mx.square(c.decode(c.encode(x), mx.float32) - x)))

    plain, clipped = err("affine_block_kv", "keys"), err("affine_block_kv_mse", "keys")
    assert clipped <= plain and (bits == 4 or clipped < 0.9 * plain), (plain, clipped)
    # symmetric scale-only values (one float16 per 64 coordinates, 0.25 bit less) against MLX's affine (scale and
    # bias): within 10 % of its error at 4 bits, below it at 2 and 3
    assert err("kblock_vsym", "values") < (1.1 if bits == 4 else 0.95) * err("affine", "values", group_size=None)
    # one-byte log-grid scales (0.125 bit less again): within 3 % of float16 scales' error
    assert err("kblock_vsym8", "values") < 1.03 * err("kblock_vsym", "values")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("block", [32, 128])
def test_clipped_quantize_equals_quantizing_every_candidate(bits, block):
    """`clipped_quantize` scores the clip candidates on mx.quantize's grid without quantizing them: the same arrays,
    bit for bit, as quantizing every candidate and keeping the least squared error (constant groups included)."""
    import mlx.core as mx

    from veloxquant_mlx.codecs.affine_block_kv import clip_candidates, clipped_quantize

    k1, k2, k3 = mx.random.split(mx.random.key(bits * 1000 + block), 3)
    y = mx.random.normal((1, 3, 16, 256), key=k1) * 3 * mx.random.uniform(shape=(1, 3, 16, 1), key=k2) \
        + mx.random.normal((1, 3, 16, 1), key=k3)
    y[:, :, :2, :block] = 0.5   # constant groups: MLX's zero-edge branch
    y[:, :, 2, :block] = 0.0
    cands = clip_candidates(y, block)  # (R, ...): quantize each, keep the least squared error per group
    w_q, scales, biases = mx.quantize(cands, group_size=block, bits=bits)
    err = mx.dequantize(w_q, scales, biases, group_size=block, bits=bits) - y[None]
    best = mx.argmin(mx.sum(mx.square(err).reshape(*scales.shape, block), axis=-1), axis=0)[None]
    words = w_q.reshape(*scales.shape, -1)
    want = (mx.take_along_axis(words, best[..., None], axis=0)[0].reshape(w_q.shape[1:]),
            mx.take_along_axis(scales, best, axis=0)[0], mx.take_along_axis(biases, best, axis=0)[0])
    got = clipped_quantize(y, block, bits)
    assert bits == 8 or int(mx.sum(best != 0)) > 0  # some group really clipped (at 8 bits min-max wins)
    for name, a, b in zip(("w_q", "scales", "biases"), want, got):
        assert a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b)), name


def test_log_grid_scales_are_one_byte_and_cover_their_range():
    """kblock_vsym8's value scales: uint8 codes, 8 grid points per octave; zeros stay zeros; the range ends clamp
    (tiny groups take the smallest scale, huge ones the largest) instead of overflowing; inf or NaN stays
    non-finite."""
    import mlx.core as mx
    import numpy as np

    from veloxquant_mlx.codecs.affine_sym_log import (LOG_OFFSET, LOG_STEPS, AffineSymLogScaleValueCodec,
                                                      decode_log_scales, log_scale_codes)

    c = AffineSymLogScaleValueCodec(64, 4)
    assert c.token_fields()["scales"][1] == mx.uint8 and c.bytes_per_token_head() == 64 * 4 / 8 + 1
    s = decode_log_scales(mx.array([0, 1, LOG_OFFSET, LOG_OFFSET + LOG_STEPS, 255], dtype=mx.uint8)).tolist()
    assert s[0] == 0 and s[2] == 1.0 and s[3] == 2.0 and s[1] == pytest.approx(2 ** (-141 / 8))
    assert s[1] < s[2] and np.isnan(s[4])
    inf_row = mx.concatenate([mx.full((1, 1), float("inf")), mx.ones((1, 63))], axis=1)
    y = mx.concatenate([mx.zeros((1, 64)), mx.full((1, 64), 1e-9), mx.full((1, 64), 1e6),
                        mx.random.normal((1, 64), key=mx.random.key(0)), inf_row])
    q, code = log_scale_codes(y, 4, 64)
    codes = code[:, 0].tolist()
    assert codes[:3] == [0, 1, 254] and 1 < codes[3] < 254 and codes[4] == 255
    assert decode_log_scales(code[2]).item() == 2.0 ** 14
    y = y[:4]
    q, code = q[:4], code[:4]
    back = decode_log_scales(code) * (q - 7.5)  # (4, 1) scales of one 64-group per row
    assert bool(mx.all(back[0] == 0)) and bool(mx.all(mx.isfinite(back)))
    rel = float(mx.linalg.norm(back[3] - y[3]) / mx.linalg.norm(y[3]))
    assert rel < 0.12, rel
