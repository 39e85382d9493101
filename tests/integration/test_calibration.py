"""Calibration (`veloxquant_mlx.integration.calibration`): measured once on a model, saved, loaded, bound to that model,
used by every cache built for it (how it is measured: test_measure_calibration.py)."""
from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx as vq
from veloxquant_mlx.integration.calibration import META_KEY, Calibration
from veloxquant_mlx.quant.channel_weights import MAX_LOG2, channel_weights, is_power_of_two
from veloxquant_mlx.apps.eval.memory import measure_bytes_per_token, model_kv_shape
from veloxquant_mlx.cache.prompt_cache_io import load_prompt_cache, save_prompt_cache
from veloxquant_mlx.apps.eval import perplexity_eval
from veloxquant_mlx.apps.eval.specs import with_calibration, compressed_spec
from veloxquant_mlx.cache.presets import PRESETS
from veloxquant_mlx.cache.options import CacheOptions

from _layouts import KBLOCK



def test_channel_weights_are_exact_powers_of_two_that_follow_the_optimum():
    q = mx.array([[1.0, 1.0, 16.0, 1.0]])
    k = mx.array([[1.0, 16.0, 1.0, 1.0]])
    w = channel_weights(q, k)  # w^4 ~ q / k, geometric mean 1
    assert is_power_of_two(w)
    lw = np.log2(np.array(w))[0]
    assert lw[2] > lw[0] > lw[1] and lw[0] == lw[3]
    assert np.abs(lw).max() <= MAX_LOG2
    with pytest.raises(ValueError, match="heads, d"):
        channel_weights(q, k[:, :2])


def test_calibrated_cache_beats_the_uncalibrated_one(skewed, calibration, random_tokens):
    spec = compressed_spec("tq-4b", PRESETS["tq-4b"])
    cal = with_calibration(spec, calibration, "+cal")
    # 1 + 512 tokens: the sink token and four whole blocks (nothing waits exact)
    res = perplexity_eval(skewed, random_tokens[1000:], [spec, cal], 513, n_windows=2, progress=False)
    assert res["tq-4b+cal"]["kl"] < 0.5 * res["tq-4b"]["kl"], res
    # the weights cost nothing per token: the caches store exactly as many bytes
    assert res["tq-4b+cal"]["memory"]["bytes_total"] == res["tq-4b"]["memory"]["bytes_total"]
    # ... as `veloxquant methods` measures them (within 4.25 bits at 2048 and 4096: test_quality_budgets.py)
    _, heads, d = model_kv_shape(skewed)
    m = measure_bytes_per_token(spec.make_cache, heads, d, model=skewed, context=513)  # (the window's tokens)
    assert res["tq-4b+cal"]["memory"]["bits_per_coordinate"] == pytest.approx(m["bits_per_coordinate"], rel=1e-12)


def test_weighting_keeps_exact_tokens_exact_and_attention_equal(skewed, calibration):
    caches = vq.make_prompt_cache(skewed, "tq-affine-k8v4", calibration=calibration, route_attention=False)
    c = caches[0]
    assert c.options.calibration_id == calibration.id
    mx.random.seed(3)
    k = mx.random.normal((1, 1, 10, 64)) * 3
    v = mx.random.normal((1, 1, 10, 64))
    kk, vv = c.update_and_fetch(k, v)  # 4 sink tokens + tail: every token exact
    assert mx.array_equal(kk, k) and mx.array_equal(vv, v)
    q = mx.random.normal((1, 2, 1, 64))
    out = c.attend_packed(q, 0.125, None)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=None)
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_enable_generate_and_batch_with_calibration(skewed, calibration):
    """After ``enable(model, calibration=...)`` mlx_lm builds calibrated caches; its BatchGenerator merges them and
    every sequence gets the greedy tokens it gets alone."""
    from mlx_lm.generate import BatchGenerator, generate_step

    prompts = [[1, 5, 9, 33, 2, 7, 8, 100, 3, 4] * 3, [11, 12, 13, 14, 15, 16, 17] * 4]
    vq.enable(skewed, "tq-affine-k8v4", calibration=calibration)
    try:
        assert all(c.options.calibration_id == calibration.id for c in skewed.make_cache())
        alone = [[int(t) for (t, _), _ in zip(generate_step(mx.array(p), skewed, max_tokens=6), range(6))]
                 for p in prompts]
        gen = BatchGenerator(skewed, max_tokens=6)
        uids = gen.insert(prompts)
        got = {}
        while responses := gen.next_generated():
            for r in responses:
                got.setdefault(r.uid, []).append(int(r.token))
        gen.close()
    finally:
        vq.disable(skewed)
    assert [got[u] for u in uids] == alone


def test_save_load_round_trip(calibration, skewed, tmp_path):
    path = str(tmp_path / "cal.safetensors")
    calibration.save(path)
    back = Calibration.load(path, skewed)
    assert back.id == calibration.id and back.text == calibration.text and back.power == calibration.power
    for name, a in calibration.arrays.items():
        assert mx.array_equal(back.arrays[name], a), name
    assert "bytes" in repr(back) and back.nbytes == calibration.nbytes


def test_wrong_model_is_refused_naming_both(calibration, tiny_model, tmp_path):
    with pytest.raises(ValueError, match="was measured on llama .*but this model is llama"):
        calibration.check_model(tiny_model)
    with pytest.raises(ValueError, match="measured on"):
        vq.make_prompt_cache(tiny_model, "tq-4b", calibration=calibration)
    path = str(tmp_path / "cal.safetensors")
    calibration.save(path)
    with pytest.raises(ValueError, match="cal.safetensors"):
        Calibration.load(path, tiny_model)


def _rewrite(path, arrays=None, meta=None):
    a, m = mx.load(path, return_metadata=True)
    if arrays is not None:
        a = arrays(dict(a))
    if meta is not None:
        m = {META_KEY: json.dumps(meta(json.loads(m[META_KEY])))}
    mx.save_safetensors(path, a, metadata=m)


@pytest.mark.parametrize("damage, message", [
    (dict(arrays=lambda a: {**a, "key_weights": a["key_weights"] * 2}), "changed after it was written"),
    (dict(arrays=lambda a: {**a, "key_weights": a["key_weights"] * 3}), "powers of two"),
    (dict(arrays=lambda a: {k: v for k, v in a.items() if k != "value_power"}), "'value_power' is missing"),
    (dict(arrays=lambda a: {**a, "query_power": a["query_power"][:1]}), "'query_power' must be float32"),
    (dict(arrays=lambda a: {**a, "key_variance": -a["key_variance"]}), "'key_variance' holds negative"),
    (dict(meta=lambda m: {**m, "format": 99}), "format 99"),
    (dict(meta=lambda m: {k: v for k, v in m.items() if k != "text"}), "'text' is missing"),
])
def test_damaged_files_are_refused_naming_the_file(calibration, tmp_path, damage, message):
    path = str(tmp_path / "cal.safetensors")
    calibration.save(path)
    _rewrite(path, **damage)
    with pytest.raises(ValueError, match=message) as e:
        Calibration.load(path)
    assert "cal.safetensors" in str(e.value)


def test_unreadable_and_misnamed_files(tmp_path, calibration):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="x.safetensors"):
        Calibration.load(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Calibration.load(str(tmp_path / "none.safetensors"))
    with pytest.raises(ValueError, match="must end in"):
        calibration.save(str(tmp_path / "cal.npz"))
    other = tmp_path / "other.safetensors"
    mx.save_safetensors(str(other), {"a": mx.zeros(3)})
    with pytest.raises(ValueError, match="not a veloxquant calibration"):
        Calibration.load(str(other))


def test_bad_arguments_name_what_is_allowed(skewed, calibration):
    with pytest.raises(TypeError, match="calibration must be a veloxquant_mlx.Calibration"):
        vq.make_prompt_cache(skewed, "tq-4b", calibration="file.safetensors")
    with pytest.raises(ValueError, match="kind='packed'"):
        vq.make_prompt_cache(skewed, kind="rvq", k_bits=2, calibration=calibration)
    with pytest.raises(ValueError, match="power must be >= 0"):
        vq.calibrate(skewed, [1, 2, 3], power=-1)
    with pytest.raises(ValueError, match="tokenizer"):
        vq.calibrate(skewed)
    with pytest.raises(ValueError, match=r"tokens\[0\]"):
        vq.calibrate(skewed, [1])
    with pytest.raises(ValueError, match="channel_log2"):
        CacheOptions(calibration_id="x", channel_log2=((( 9,),), ((0,),)))
    with pytest.raises(ValueError, match="come together"):
        CacheOptions(calibration_id="x")


def test_prompt_cache_files_remember_their_calibration(skewed, calibration, tmp_path):
    caches = vq.make_prompt_cache(skewed, "tq-4b", calibration=calibration)
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6] * 20])
    ref = skewed(x, cache=caches)
    path = str(tmp_path / "p.safetensors")
    save_prompt_cache(path, caches)
    back = load_prompt_cache(path, calibration=calibration)
    assert all(c.options == o.options for c, o in zip(back, caches))
    nxt = mx.array([[7]])
    with vq.use_packed_attention():
        assert mx.allclose(skewed(nxt, cache=back), skewed(nxt, cache=caches), atol=1e-5)
    assert ref.shape[1] == 160
    other = Calibration(arrays={**calibration.arrays, "key_weights": mx.ones_like(calibration.arrays["key_weights"])},
                        model=calibration.model, text=calibration.text)
    with pytest.raises(ValueError, match=r"p\.safetensors.*layer 0 was saved with calibration"):
        load_prompt_cache(path, calibration=other)
    plain = vq.make_prompt_cache(skewed, "tq-4b")
    skewed(x, cache=plain)
    save_prompt_cache(path, plain)
    with pytest.raises(ValueError, match="saved with no calibration"):
        load_prompt_cache(path, calibration=calibration)


def test_calibration_picks_the_key_rotation_of_block_keys(skewed, calibration):
    """`Calibration.key_rotation`: "none" for a layer whose queries read the channels where its keys vary little
    (`unrotated_score_error` < `UNROTATED_BELOW` for every KV head), else None; the builder applies it to block
    keys only (an explicit ``key_rotation`` wins), says so in one line, and the caches code what it says."""
    import dataclasses

    from veloxquant_mlx.integration.calibration import UNROTATED_BELOW
    from veloxquant_mlx.quant.channel_weights import unrotated_score_error

    a = dict(calibration.arrays)
    L, H, d = a["query_power"].shape
    var = mx.concatenate([mx.full((L, H, d // 2), 4.0), mx.full((L, H, d // 2), 0.01)], axis=-1)
    reads_quiet = mx.concatenate([mx.full((L, H, d // 2), 0.01), mx.full((L, H, d // 2), 4.0)], axis=-1)
    # layer 0: the queries read the quiet half; layer 1: every channel alike (a rotation costs nothing there)
    a["key_variance"] = var
    a["query_power"] = mx.concatenate([reads_quiet[:1], mx.ones((L - 1, H, d))], axis=0)
    cal = dataclasses.replace(calibration, arrays=a)
    errs = [unrotated_score_error(a["query_power"][i], a["key_variance"][i]) for i in range(L)]
    assert float(errs[0].max()) < UNROTATED_BELOW <= float(errs[1].min())
    assert [cal.key_rotation(i) for i in range(L)] == ["none"] + [None] * (L - 1)
    with pytest.raises(ValueError, match="layer must be in"):
        cal.key_rotation(L)

    builder = vq.KVCacheBuilder(KBLOCK, calibration=cal)
    caches = builder.build(skewed)
    skewed(mx.array([[(7 * i) % 60 + 1 for i in range(200)]]), cache=caches)
    assert [c.rows.k_codec.rotation.kind for c in caches] == ["none"] + ["haar"] * (L - 1)
    assert any("block keys of layer 0 coded in the model's own channels" in n for n in builder.notes)
    forced = vq.make_prompt_cache(skewed, KBLOCK, calibration=cal, key_rotation="haar")
    skewed(mx.array([[(7 * i) % 60 + 1 for i in range(200)]]), cache=forced)
    assert all(c.rows.k_codec.rotation.kind == "haar" for c in forced)
    # per-token codes keep their rotation whatever the calibration says
    per_token = vq.make_prompt_cache(skewed, k_bits=4, codec="affine", calibration=cal)
    assert all(c.options.key_rotation is None for c in per_token)
