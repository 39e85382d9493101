"""benchmarks/_prerope.py, issue 47's pre-RoPE key probe: it must change only what the keys are coded as.

Around an exact cache it gives the plain cache's logits (RoPE undone and re-applied at the right positions, chunked
prefill and decode); around one of ours it stores the same bytes; attention never reaches the inner cache's codes.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

import veloxquant_mlx as vq
from veloxquant_mlx.apps.eval.memory import stored_nbytes


def _load_script(path: Path):
    """The benchmark script at ``path`` as a module, loaded by its path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_prerope = _load_script(Path(__file__).resolve().parents[2] / "benchmarks" / "_prerope.py")
PreRopeKeys, pre_rope_caches, rope_settings = _prerope.PreRopeKeys, _prerope.pre_rope_caches, _prerope.rope_settings


def _run(model, caches, toks):
    outs = [model(toks[:, :40], cache=caches), model(toks[:, 40:90], cache=caches)]
    outs += [model(toks[:, t:t + 1], cache=caches) for t in range(90, 96)]
    return mx.concatenate([o[0] for o in outs], axis=0)


def test_exact_inner_cache_gives_the_plain_logits(tiny_model):
    toks = mx.random.randint(0, 128, (1, 96), key=mx.random.key(3))
    plain = _run(tiny_model, [KVCache() for _ in tiny_model.layers], toks)
    probe = _run(tiny_model, pre_rope_caches(tiny_model, [KVCache() for _ in tiny_model.layers]), toks)
    assert float(mx.abs(plain - probe).max()) < 1e-4 * float(mx.abs(plain).max())


def test_inner_cache_holds_keys_before_rope(tiny_model):
    """The inner cache's keys are the layer's RoPE undone: re-rotating them at their positions gives what the plain
    cache holds."""
    toks = mx.random.randint(0, 128, (1, 50), key=mx.random.key(4))
    plain = [KVCache() for _ in tiny_model.layers]
    inner = [KVCache() for _ in tiny_model.layers]
    tiny_model(toks, cache=plain)
    tiny_model(toks, cache=pre_rope_caches(tiny_model, inner))
    r = rope_settings(tiny_model.layers[0].self_attn.rope)
    k_pre, k_post = inner[0].state[0], plain[0].state[0]
    assert float(mx.abs(k_pre - k_post).max()) > 1e-2  # RoPE moved them (not a pass-through)
    again = mx.fast.rope(k_pre, r["dims"], traditional=r["traditional"], base=r["base"], scale=r["scale"], offset=0)
    assert float(mx.abs(again - k_post).max()) < 1e-4


def test_wrapping_ours_keeps_its_bytes_and_hides_its_codes(tiny_model):
    toks = mx.random.randint(0, 128, (1, 300), key=mx.random.key(5))
    ours = vq.make_prompt_cache(tiny_model, "tq-4b")
    inner = vq.make_prompt_cache(tiny_model, "tq-4b")
    for c in inner:
        c.fetch_placeholders = False
    probe = pre_rope_caches(tiny_model, inner)
    a, b = tiny_model(toks, cache=ours), tiny_model(toks, cache=probe)
    assert [stored_nbytes(c) for c in ours] == [stored_nbytes(c) for c in probe]
    assert not hasattr(probe[0], "attend_packed") and hasattr(ours[0], "attend_packed")
    assert bool(mx.all(mx.isfinite(b))) and float(mx.abs(a - b).max()) > 0  # other codes, same model


def test_refuses_what_it_does_not_run(tiny_model):
    cache = PreRopeKeys(KVCache(), rope_settings(tiny_model.layers[0].self_attn.rope))
    k = mx.zeros((2, 1, 3, 64))
    with pytest.raises(ValueError, match="one sequence"):
        cache.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="plain mlx.nn.RoPE"):
        rope_settings(object())
    with pytest.raises(ValueError, match="caches for"):
        pre_rope_caches(tiny_model, [KVCache()])


def test_unrotated_probe_codes_the_model_channels(tiny_model):
    """With the key rotation taken out, an exact-ish 8-bit inner cache still gives (nearly) the plain logits, and
    the codec codes ``Pi^T k``: rotating what it returns gives the keys back."""
    toks = mx.random.randint(0, 128, (1, 96), key=mx.random.key(6))
    plain = _run(tiny_model, [KVCache() for _ in tiny_model.layers], toks)
    for pre in (False, True):
        inner = vq.make_prompt_cache(tiny_model, "tq-affine-k8v4")
        for c in inner:
            c.fetch_placeholders = False
        probe = pre_rope_caches(tiny_model, inner, pre_rope=pre, unrotated=True)
        out = _run(tiny_model, probe, toks)
        assert probe[0].key_rotation is inner[0].rows.k_codec.rotation
        assert float(mx.abs(out - plain).max()) < 0.05 * float(mx.abs(plain).max())


def test_refuses_an_evicting_window(tiny_model):
    """Positions are the stored slots: a window that evicts would get RoPE at the wrong positions, so it is refused."""
    inner = vq.make_prompt_cache(tiny_model, "tq-4b", max_kv_size=64)
    for c in inner:
        c.fetch_placeholders = False
    probe = pre_rope_caches(tiny_model, inner)
    toks = mx.random.randint(0, 128, (1, 150), key=mx.random.key(7))
    with pytest.raises(ValueError, match="sliding window"):
        for s0 in range(0, 150, 50):  # (one chunk keeps all of itself; the window evicts across chunks)
            tiny_model(toks[:, s0:s0 + 50], cache=probe)


def test_unrotated_refuses_a_cache_without_a_rotated_key_codec(tiny_model):
    cache = PreRopeKeys(KVCache(), rope_settings(tiny_model.layers[0].self_attn.rope), unrotated=True)
    cache.inner.options = vq.CacheOptions()  # (what ours carry; mlx_lm's cache has no key codec)
    k = mx.zeros((1, 1, 3, 64))
    with pytest.raises(ValueError, match="rotation"):
        cache.update_and_fetch(k, k)


def test_offset_probe_codes_keys_less_their_roped_mean_and_gives_them_back(tiny_model):
    """``offset=True``: an exact inner cache gives the plain logits; what it holds is each key less ``R_t mu``, mu the
    first update's mean key before RoPE (so the first update's stored keys, RoPE undone, average to zero)."""
    toks = mx.random.randint(0, 128, (1, 96), key=mx.random.key(6))
    plain = _run(tiny_model, [KVCache() for _ in tiny_model.layers], toks)
    inner = [KVCache() for _ in tiny_model.layers]
    probe = _run(tiny_model, pre_rope_caches(tiny_model, inner, pre_rope=False, offset=True), toks)
    assert float(mx.abs(plain - probe).max()) < 1e-4 * float(mx.abs(plain).max())
    r = rope_settings(tiny_model.layers[0].self_attn.rope)
    held = inner[0].state[0][:, :, :40]  # the first update's 40 keys, as stored (after RoPE, less R_t mu)
    pre = mx.fast.rope(held, r["dims"], traditional=r["traditional"], base=r["base"], scale=-r["scale"], offset=0)
    assert float(mx.abs(mx.mean(pre, axis=2)).max()) < 1e-4
    assert float(mx.abs(mx.mean(held, axis=2)).max()) > 1e-3  # (not the post-RoPE mean: the offset rotates)
