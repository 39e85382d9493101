"""KVCacheBuilder / make_prompt_cache (`veloxquant_mlx.integration.builder`): what each model's layers get (attention
on the codes while the caches live: test_routing_while_alive.py)."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import gemma3_text, llama, qwen3

import veloxquant_mlx as vq
from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache, TurboQuantRotatingPackedCache
from veloxquant_mlx.compat.turboquant_rvq_cache import TurboQuantRVQKVCache

from _layouts import KBLOCK

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)


def llama_model(layers=3):
    return llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=layers, rms_norm_eps=1e-5, **COMMON))


def gemma_model():
    return gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", num_hidden_layers=4, head_dim=32, sliding_window=16,
        sliding_window_pattern=2, query_pre_attn_scalar=32, **COMMON))


class HybridModel:
    """Stands in for a hybrid (SSM + attention) model: its own make_cache decides the layout."""

    layers = [object(), object(), object()]

    def make_cache(self):
        return [mlx_cache.ArraysCache(2), mlx_cache.KVCache(),
                mlx_cache.CacheList(mlx_cache.KVCache(), mlx_cache.ArraysCache(1))]


def test_fresh_caches_on_every_call():
    model = llama_model()
    # explicit options: the default (affine_block keys) needs head_dim >= 32, this model's is 16
    a, b = vq.make_prompt_cache(model, k_bits=4), vq.make_prompt_cache(model, k_bits=4)
    assert len(a) == 3 and all(type(c) is TurboQuantPackedCache for c in a)
    assert all(x is not y for x, y in zip(a, b))
    assert a[0].config.head_dim == 16  # read from the model (hidden_size / num_attention_heads)
    c = KVCacheBuilder.for_model(model, vq.KVCacheConfig(method="turboquant_prod", bit_width_inlier=3))
    assert all(x.config.method == "turboquant_prod" and x.k_bits == 3 for x in c)


def test_per_layer_bits_and_options():
    model = llama_model()
    caches = vq.make_prompt_cache(model, k_bits=[4, 3, 2], v_bits=2, recent=8, sink=4, n_outlier_channels=4)
    assert [c.k_bits for c in caches] == [4, 3, 2] and all(c.v_bits == 2 for c in caches)
    assert all((c.recent, c.sink, c.config.n_outlier_channels) == (8, 4, 4) for c in caches)
    with pytest.raises(ValueError, match="k_bits has 2 entries"):
        vq.make_prompt_cache(model, k_bits=[4, 3])
    with pytest.raises(ValueError, match=r"k_bits\[1\]"):
        vq.make_prompt_cache(model, k_bits=[4, 9, 4])
    with pytest.raises(TypeError, match="unknown option"):
        vq.make_prompt_cache(model, kbits=4)
    with pytest.raises(ValueError, match="head_dim"):
        vq.make_prompt_cache(model, head_dim=32)
    with pytest.raises(ValueError, match="kind"):
        vq.make_prompt_cache(model, kind="fp8")


def test_sliding_window_layers_get_the_rotating_cache():
    model = gemma_model()
    base = model.make_cache()
    ours = vq.make_prompt_cache(model, k_bits=4, sink=2)
    for b, o in zip(base, ours):
        if isinstance(b, mlx_cache.RotatingKVCache):
            assert type(o) is TurboQuantRotatingPackedCache
            assert (o.max_size, o.keep) == (b.max_size, b.keep)
            assert o.sink == 0  # gemma3's windows keep no prefix, so no sink can survive in them
        else:
            assert type(o) is TurboQuantPackedCache and o.sink == 2
    with pytest.raises(ValueError, match="sliding-window"):
        vq.make_prompt_cache(model, kind="rvq", k_bits=2)


def test_max_kv_size_gives_rotating_caches_like_mlx_lm():
    class NoMakeCache:  # mlx_lm applies max_kv_size only to models without make_cache
        layers = [object()] * 3

    caches = vq.make_prompt_cache(NoMakeCache(), max_kv_size=32)
    assert all(type(c) is TurboQuantRotatingPackedCache and (c.max_size, c.keep) == (32, 4) for c in caches)


def test_non_attention_caches_stay_the_models_own():
    caches = vq.make_prompt_cache(HybridModel(), k_bits=4)
    assert type(caches[0]) is mlx_cache.ArraysCache and type(caches[1]) is TurboQuantPackedCache
    assert type(caches[2]) is mlx_cache.CacheList
    assert type(caches[2][0]) is TurboQuantPackedCache and type(caches[2][1]) is mlx_cache.ArraysCache


def test_seed_rvq_kind():
    caches = vq.make_prompt_cache(llama_model(2), kind="rvq", k_bits=1)
    assert all(type(c) is TurboQuantRVQKVCache and c.assigned_bits == 1 for c in caches)
    assert caches[0].config.method == "turboquant_rvq" and caches[0].config.head_dim == 16
    with pytest.raises(ValueError, match="float16"):
        vq.make_prompt_cache(llama_model(2), kind="rvq", v_bits=2)


def test_bad_model_and_config():
    with pytest.raises(TypeError, match="layers"):
        vq.make_prompt_cache(object())
    with pytest.raises(TypeError, match="KVCacheConfig"):
        KVCacheBuilder.for_model(llama_model(), {"bit_width_inlier": 4})


def family_models():
    mx.random.seed(0)  # the measured errors below are for these weights
    return {
        "llama": llama_model(2),
        "gemma3": gemma_model(),
        "qwen3": qwen3.Model(qwen3.ModelArgs(
            model_type="qwen3", num_hidden_layers=2, head_dim=16, tie_word_embeddings=True,
            max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5, **COMMON)),
    }


def logit_error(model, cache):
    """rms(logits_ours - logits_plain) / std(logits_plain) of one decode step after a 20-token prompt."""
    plain = mlx_cache.make_prompt_cache(model)
    prompt = mx.array([list(range(20))])
    model(prompt, cache=plain)
    model(prompt, cache=cache)
    ref, out = model(mx.array([[3]]), cache=plain), model(mx.array([[3]]), cache=cache)
    assert out.shape == ref.shape == (1, 1, 64)
    return (mx.sqrt(mx.mean(mx.square(out - ref))) / mx.std(ref)).item()


# rms logit error / std vs the plain cache, measured on `family_models()` (llama / gemma3 / qwen3):
#   k8v8 0.0056 / 0.0342 / 0.0045     k7v7 0.0097 / 0.0758 / 0.0096
#   k4v3 0.1713 / 0.7793 / 0.1658     k3v2 0.2643 / 1.4526 / 0.1879
#   keys replaced by random normals: k8v8 0.36 / 0.98 / 0.60, k4v3 0.45 / 1.36 / 0.80
# (these random models amplify the cache error, gemma3's sliding-window layers most). Bound: 1.5x the
# measured error, which excludes random keys in every case and one bit fewer at 8 bits in every family.
MEASURED_ERROR = {  # family: {(k_bits, v_bits): error}
    "llama": {(8, 8): 0.0056, (4, 3): 0.1713},
    "gemma3": {(8, 8): 0.0342, (4, 3): 0.7793},
    "qwen3": {(8, 8): 0.0045, (4, 3): 0.1658},
}
MARGIN = 1.5


@pytest.mark.parametrize("family", sorted(MEASURED_ERROR))
def test_caches_run_in_a_model_of_each_family(family):
    model = family_models()[family]
    for (k_bits, v_bits), measured in MEASURED_ERROR[family].items():
        error = logit_error(model, vq.make_prompt_cache(model, k_bits=k_bits, v_bits=v_bits))
        assert error < MARGIN * measured, (k_bits, v_bits, error, measured)


def test_cache_report_and_coverage_line_say_what_was_compressed():
    from veloxquant_mlx.integration.builder import cache_report, coverage_line

    hybrid = vq.make_prompt_cache(HybridModel(), k_bits=4)
    assert cache_report(hybrid) == [("state", "ArraysCache"), ("compressed", "TurboQuantPackedCache"),
                                    ("compressed", "TurboQuantPackedCache"), ("state", "ArraysCache")]
    assert coverage_line(HybridModel(), hybrid) is None  # every attention cache compressed: nothing to say

    class Ssm:
        model_type = "ssm"

    assert coverage_line(Ssm(), [mlx_cache.ArraysCache(1), mlx_cache.ArraysCache(1)]) == (
        "veloxquant_mlx: ssm has no attention keys and values to compress (its 2 caches hold recurrent state): "
        "its caches are mlx_lm's own")
    mixed = [hybrid[1], mlx_cache.KVCache(), object(), mlx_cache.KVCache()]
    assert [kind for kind, _ in cache_report(mixed)] == ["compressed", "plain", "plain", "plain"]
    assert cache_report([object()]) == [("plain", "object is a cache kind veloxquant does not know")]
    line = coverage_line(Ssm(), mixed)
    assert line.startswith("veloxquant_mlx: ssm: 1 attention caches compressed, 3 left plain (2 x ") and line.endswith(
        "; 1 x object is a cache kind veloxquant does not know)"), line


def test_key_rotation_reaches_the_block_keys_and_spares_the_windows(tmp_path):
    """`key_rotation` (one value or one per layer) sets the rotation of the keys coded per channel over blocks (the
    full-attention layers); a sliding window codes per token and keeps ``rotation``; a saved prompt-cache file
    brings the choice back and the loaded caches continue the same logits."""
    model = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", num_hidden_layers=4, head_dim=64, sliding_window=16,
        sliding_window_pattern=2, query_pre_attn_scalar=64, **COMMON))
    caches = vq.make_prompt_cache(model, KBLOCK, key_rotation=["none", "none", "haar", "none"])
    tokens = mx.array([[(7 * i) % 64 for i in range(300)]])
    model(tokens, cache=caches)  # (the codecs are made at the first update, from the head dims seen)
    kinds = [c.rows.k_codec.rotation.kind for c in caches]
    windows = [type(c) is TurboQuantRotatingPackedCache for c in caches]
    assert windows == [True, False, True, False]
    assert kinds == ["haar", "none", "haar", "none"]  # windows: per-token codes, the rotation kept
    assert all(c.rows.v_codec.rotation.kind == "haar" for c in caches)
    path = str(tmp_path / "kr.safetensors")
    vq.save_prompt_cache(path, caches)
    loaded = vq.load_prompt_cache(path)
    assert [c.rows.k_codec.rotation.kind for c in loaded] == kinds
    step = mx.array([[5]])
    a, b = model(step, cache=caches), model(step, cache=loaded)
    assert mx.allclose(a, b, atol=1e-5).item()
    with pytest.raises(ValueError, match="key_rotation has 2 entries"):
        vq.make_prompt_cache(model, KBLOCK, key_rotation=["none", "haar"])


def _fresh_copy(model):
    """A new model object with ``model``'s weights (the builder keeps one probe per model object)."""
    from mlx.utils import tree_flatten

    new = type(model)(model.args)
    new.load_weights(list(tree_flatten(model.parameters())))
    return new


def test_key_rotation_probe_unrotates_block_keys_without_a_calibration(skewed, tiny_model, tmp_path):
    """No calibration, no ``key_rotation``: the block keys of the layers the probe flags are coded without a
    rotation, said in one line; an explicit ``key_rotation`` and per-token codes are left alone; a saved cache
    loads with what it was coded with and continues as the uninterrupted one."""
    from veloxquant_mlx.cache.prompt_cache_io import load_prompt_cache, save_prompt_cache

    prompt = mx.array([[(7 * i) % 60 + 1 for i in range(200)]])
    builder = KVCacheBuilder(KBLOCK)
    caches = builder.build(skewed)
    skewed(prompt, cache=caches)
    assert [c.rows.k_codec.rotation.kind for c in caches] == ["none"] * len(skewed.layers)
    layers = ", ".join(map(str, range(len(skewed.layers))))
    assert sum(f"key-rotation probe: the block keys of layers {layers} coded" in n for n in builder.notes) == 1
    plain = KVCacheBuilder(KBLOCK)
    rotated = plain.build(tiny_model)
    tiny_model(prompt, cache=rotated)
    assert all(c.rows.k_codec.rotation.kind == "haar" for c in rotated)
    assert not any("probe" in n for n in plain.notes)
    forced = vq.make_prompt_cache(skewed, KBLOCK, key_rotation="haar")
    skewed(prompt, cache=forced)
    assert all(c.rows.k_codec.rotation.kind == "haar" for c in forced)
    assert all(c.options.key_rotation is None for c in vq.make_prompt_cache(skewed, k_bits=4, codec="affine"))

    path = str(tmp_path / "probed.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    nxt = mx.array([[5]])
    assert [c.options.key_rotation for c in loaded] == ["none"] * len(skewed.layers)
    assert mx.array_equal(skewed(nxt, cache=loaded), skewed(nxt, cache=caches)).item()


def test_budget_presets_give_block_keys_to_the_layers_the_probe_unrotates(skewed, tiny_model, tmp_path):
    """tq-4b codes keys per token (`token_lloyd8`); on a model whose queries read key channels that vary little (the
    probe unrotates them) its full-attention layers take the layout's ``CHANNEL_LAYOUT`` instead: block keys in the
    model's own channels, said in one line; elsewhere the per-token codes stay. A
    saved file brings the per-layer layouts back."""
    from veloxquant_mlx.cache.prompt_cache_io import load_prompt_cache, save_prompt_cache
    from veloxquant_mlx.codecs.token_lloyd import TokenLloydCodec

    prompt = mx.array([[(7 * i) % 60 + 1 for i in range(200)]])
    builder = KVCacheBuilder("tq-4b")
    caches = builder.build(skewed)
    skewed(prompt, cache=caches)
    codec, block = TokenLloydCodec.CHANNEL_LAYOUT
    assert [(c.options.codec, c.options.group_size, c.options.key_rotation) for c in caches] == \
        [(codec, block, "none")] * len(skewed.layers)
    assert all(c.rows.k_codec.rotation.kind == "none" for c in caches)
    assert any("key-rotation probe: the block keys of layers" in n for n in builder.notes)
    plain = vq.make_prompt_cache(tiny_model, "tq-4b")
    tiny_model(prompt, cache=plain)
    assert all(c.options.codec == "token_lloyd8" and c.rows.k_codec.rotation.kind == "haar" for c in plain)
    path = str(tmp_path / "mixed.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [c.options.codec for c in loaded] == [codec] * len(skewed.layers)
    nxt = mx.array([[5]])
    assert mx.array_equal(skewed(nxt, cache=loaded), skewed(nxt, cache=caches)).item()


def test_key_rotation_probe_runs_once_per_model_and_a_failure_is_said(tiny_model, monkeypatch):
    from veloxquant_mlx.integration import builder as builder_module

    calls = []
    real = builder_module.probe_key_rotations
    monkeypatch.setattr(builder_module, "probe_key_rotations", lambda m: calls.append(m) or real(m))
    model = _fresh_copy(tiny_model)
    for _ in range(3):
        vq.make_prompt_cache(model, KBLOCK)
    vq.make_prompt_cache(model)  # the default: block keys too, the same probe
    assert len(calls) == 1

    def boom(m):
        raise RuntimeError("boom")

    monkeypatch.setattr(builder_module, "probe_key_rotations", boom)
    other = _fresh_copy(tiny_model)
    b = KVCacheBuilder(KBLOCK)
    caches = b.build(other)
    other(mx.array([[1, 2, 3]]), cache=caches)
    assert [n for n in b.notes if "probe" in n] == ["key-rotation probe failed (RuntimeError: boom): block keys "
                                                    "keep the rotation"]
    assert all(c.rows.k_codec.rotation.kind == "haar" for c in caches)
