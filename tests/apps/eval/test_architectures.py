"""Every architecture the installed mlx_lm ships, on a tiny random model (veloxquant_mlx.apps.eval.architectures):
exact storage gives mlx_lm's logits, the default configuration runs, every attention cache is compressed or left
plain with its reason; in float32 (float16 and bfloat16: test_architectures_half_precision.py)."""
import pkgutil
import warnings

import mlx.core as mx
import mlx_lm.models
import pytest

import veloxquant_mlx as vq
from veloxquant_mlx.apps.eval import architectures as arch
from veloxquant_mlx.apps.eval.tiny_configs import CONFIGS, METAL_ONLY, NEEDS

# mlx_lm.models modules that are no architecture (shared layers, caches, helpers)
NOT_MODELS = {"activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline", "rope_utils",
              "ssm", "switch_layers"}
# attention caches left plain on purpose, and why (anything else plain fails the test)
PLAIN_ON_PURPOSE = {
    "deepseek_v41": "LayerCache is a cache kind veloxquant does not know",
    "deepseek_v32": "a sparse-attention indexer's keys, which the model reads as raw arrays",
    "glm_moe_dsa": "a sparse-attention indexer's keys, which the model reads as raw arrays",
    "minimax_m3_vl": "a sparse-attention indexer's keys, which the model reads as raw arrays",
}


def test_every_shipped_architecture_has_a_configuration():
    shipped = {m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)} - NOT_MODELS
    assert shipped - set(CONFIGS) <= set(NEEDS), f"architectures without a tiny configuration: {shipped - set(CONFIGS)}"
    assert set(CONFIGS) <= shipped, f"configurations of architectures mlx_lm no longer ships: {set(CONFIGS) - shipped}"


@pytest.fixture(scope="module")
def results32():
    return {name: arch.check(name, "float32") for name in CONFIGS}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_architecture_float32(name, results32):
    r = results32[name]
    if name in METAL_ONLY and not mx.metal.is_available():
        assert r.status == "not run" and "Metal" in r.detail
        return
    assert r.ok and r.status != "not run", f"{name}: {r.status}: {r.detail}"
    assert r.exact_error <= max(arch.TOLERANCE["float32"], r.rounding_error)
    assert r.default_finite
    if name in PLAIN_ON_PURPOSE:
        assert set(r.plain) == {PLAIN_ON_PURPOSE[name]}, r.plain
    else:
        assert not r.plain, f"{name}: attention caches left plain: {r.plain}"
    assert (r.status == "no attention") == (name in ("mamba", "mamba2", "rwkv7")), (name, r.status)


def test_wrong_plumbing_is_caught(monkeypatch):
    """The check fails what it must: attention from the codes that is off by 2 % (as a wrong scale or mask would be)
    is reported as wrong; placeholders that reach mlx_lm's own attention raise, never a silent wrong output."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
    attend = TurboQuantPackedCache._attend
    monkeypatch.setattr(TurboQuantPackedCache, "_attend", lambda self, *a, **k: attend(self, *a, **k) * 1.02)
    r = arch.check("llama")
    assert r.status == "wrong" and r.exact_error > arch.TOLERANCE["float32"], (r.status, r.exact_error)
    monkeypatch.undo()

    from mlx_lm.models.cache import make_prompt_cache
    from veloxquant_mlx.attention import hook
    model = arch.build("llama")
    caches = [TurboQuantPackedCache(codec="float16", k_bits=16, v_bits=16) for _ in model.layers]
    hook.set_active(True)  # placeholders handed out, but mlx_lm's attention is not routed: it reads zeros
    try:
        with pytest.raises(RuntimeError, match="attend_packed was never called"):
            arch.run(model, caches, arch.tokens())
    finally:
        hook.set_active(False)
    assert arch.check("llama").ok  # (the patch is gone)
    del make_prompt_cache


def test_enable_says_what_stays_plain():
    """One line for a model with nothing to compress (no-op) and for one with attention layers left plain."""
    for name, expected in (("mamba2", "no attention keys and values"), ("deepseek_v32", "3 left plain")):
        model = arch.build(name)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            vq.enable(model)
        vq.disable(model)
        assert len(w) == 1 and expected in str(w[0].message), [str(x.message) for x in w]
    model = arch.build("qwen3_next")  # a hybrid with every attention layer compressed: nothing to say
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        vq.enable(model)
    vq.disable(model)
    assert not w, [str(x.message) for x in w]


def test_any_head_dim_is_compressed():
    """head_dims that no mx.quantize group divides (16, 48, 80) or that the default's value groups of 64 do not
    (96): every layer is compressed all the same (another group size, or Lloyd-Max codes at the same bits), as
    close to the plain cache as at the usual head dims."""
    from mlx_lm.models import llama
    for d in (16, 48, 80, 96):
        args = llama.ModelArgs.from_dict(dict(CONFIGS["llama"], head_dim=d))
        mx.random.seed(0)
        model = llama.Model(args)
        from mlx_lm.models.cache import make_prompt_cache
        toks = arch.tokens()
        ref = arch.run(model, make_prompt_cache(model), toks)
        caches = vq.make_prompt_cache(model)
        got = arch.run(model, caches, toks)
        assert all(type(c).__name__.startswith("TurboQuant") for c in caches)
        with warnings.catch_warnings(record=True) as w:  # enable says how the layout was fitted, in one line
            warnings.simplefilter("always")
            vq.enable(model)
        vq.disable(model)
        said = [str(x.message) for x in w]
        kinds = [t for t in said if t.startswith("veloxquant_mlx: layers by kind: ")]  # a window and a full layer
        assert len(kinds) == 1 and "sliding window of" in kinds[0] and "full attention" in kinds[0], said
        fitted = [t for t in said if t not in kinds]
        if d % 32:  # (no mx.quantize group divides it: Lloyd-Max codes at the default's bits)
            assert fitted == [f"veloxquant_mlx: head_dim {d}: codec 'affine_block' cannot take it, coded with "
                              "'lloyd_max' at the same bits"], fitted
        else:  # 96: value groups of 32 instead of 64, the layout's default: nothing to say
            assert fitted == [], fitted
        assert bool(mx.all(mx.isfinite(got)).item())
        # (this random model's logits move by up to 0.3-0.5 of their spread at every head_dim under the default,
        # 64 and 128 included; its top-1 agrees at 94-98 % of the positions)
        err = float(mx.max(mx.abs(got - ref)).item()) / float(mx.std(ref).item())
        top1 = float(mx.mean(mx.argmax(got, axis=-1) == mx.argmax(ref, axis=-1)).item())
        assert err < 0.6 and top1 >= 0.9, (d, err, top1)


def test_readme_supported_models_is_the_generated_table(results32):
    """README's "Supported models" table is what `python -m veloxquant_mlx.apps.eval.architectures --summary` writes."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    begin, end = "<!-- supported-models:begin -->\n", "<!-- supported-models:end -->"
    assert begin in text and end in text
    table = text[text.index(begin) + len(begin):text.index(end)]
    assert table == arch.summary_markdown(list(results32.values())), "regenerate: python -m " \
        "veloxquant_mlx.apps.eval.architectures --summary FILE, and paste FILE between the markers"


def test_placeholders_changed_on_the_way_raise():
    """A model that computes on the placeholders it fetched (a cast, a tile of the heads) before attention gets an
    error naming the fix, never mlx_lm's attention over zeros; another cache's own placeholders are attended from
    that cache's codes (a layer reusing an earlier layer's keys and values, called with cache=None)."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
    from veloxquant_mlx.integration.routing import packed_scaled_dot_product_attention as routed, use_packed_attention
    mx.random.seed(3)
    k, v, q = (mx.random.normal((1, 2, 40, 32)) for _ in range(3))
    with use_packed_attention():
        cache = TurboQuantPackedCache(codec="float16", k_bits=16, v_bits=16)
        keys, values = cache.update_and_fetch(k, v)
        expected = mx.fast.scaled_dot_product_attention(q[:, :, -1:], k, v, scale=0.2, mask=None)
        shared = routed(q[:, :, -1:], keys, values, None, scale=0.2, mask=None)  # another layer: cache=None
        assert float(mx.max(mx.abs(shared - expected)).item()) < 1e-2
        with pytest.raises(RuntimeError, match="fetch_placeholders=False"):
            routed(q[:, :, -1:], keys.astype(mx.float16), values, cache, scale=0.2, mask=None)
        keys, values = cache.update_and_fetch(k[:, :, :1], v[:, :, :1])  # the next step's fetch
        with pytest.raises(RuntimeError, match="fetch_placeholders=False"):
            routed(q[:, :, -1:], mx.tile(keys, (1, 2, 1, 1)), mx.tile(values, (1, 2, 1, 1)), cache, scale=0.2,
                   mask=None)  # (plamo's pattern: the heads tiled, not repeated as GQA reads them)


def test_chunked_attention_saves_loads_and_continues():
    """Llama 4's chunked-attention layers (`TurboQuantChunkedPackedCache`) past two chunk boundaries: saved with
    mlx_lm's own prompt-cache functions, loaded back, they continue exactly as the caches never saved."""
    import os
    import tempfile
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
    model, toks = arch.build("llama4"), arch.tokens()
    vq.enable(model)
    try:
        caches = make_prompt_cache(model)
        assert [type(c).__name__ for c in caches].count("TurboQuantChunkedPackedCache") == 3
        model(toks[:, :70], cache=caches)
        assert (caches[0].offset, caches[0].start_position) == (70, 70 - 32)  # the newest chunk_size tokens
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "prompt.safetensors")
            save_prompt_cache(path, caches)
            loaded = load_prompt_cache(path)
        assert [c.start_position for c in loaded[:3]] == [38] * 3
        for t in range(70, 78):
            a, b = model(toks[:, t:t + 1], cache=caches), model(toks[:, t:t + 1], cache=loaded)
            assert mx.array_equal(a, b)
        with pytest.raises(ValueError, match="does not batch"):
            type(caches[0]).merge([caches[0], loaded[0]])
    finally:
        vq.disable(model)
