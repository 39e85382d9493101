"""The attention shape of an mlx_lm model (`veloxquant_mlx.integration.model_shape`): layers, KV heads and head_dim
from ``model.args`` (or a wrapper's text model args), the KV heads a rank really holds after sharding, and errors
naming what the model does not say."""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from veloxquant_mlx.apps.eval.tiny_configs import CONFIGS
from veloxquant_mlx.integration import model_shape


def fake(layers=2, **args):
    return SimpleNamespace(layers=[SimpleNamespace() for _ in range(layers)], args=SimpleNamespace(**args))


def test_a_dense_model(tiny_model):
    assert model_shape.model_kv_shape(tiny_model) == (2, 1, 64)
    assert model_shape.attention_heads(tiny_model) == (2, 1)
    assert model_shape.head_dim(tiny_model) == 64 and model_shape.vocab_size(tiny_model) == 128
    assert model_shape.local_kv_heads(tiny_model) == 1 and model_shape.text_args(tiny_model) is tiny_model.args


def test_head_dim_and_kv_heads_when_not_stated():
    m = fake(hidden_size=96, num_attention_heads=4)  # no head_dim: hidden / heads; no KV heads: one per query head
    assert model_shape.model_kv_shape(m) == (2, 4, 24)
    m = fake(hidden_size=96, num_attention_heads=4, head_dim=True, num_key_value_heads=0)  # not counts: ignored
    assert model_shape.attention_heads(m) == (4, 4) and model_shape.head_dim(m) == 24
    odd = fake(hidden_size=100, num_attention_heads=3)
    assert model_shape.head_dim(odd) is None
    with pytest.raises(ValueError, match=r"cannot read the attention shape of SimpleNamespace from model.args"):
        model_shape.model_kv_shape(odd)
    with pytest.raises(ValueError, match="SimpleNamespace is not an mlx_lm model: it has no .layers"):
        model_shape.model_kv_shape(SimpleNamespace(args=odd.args))


def test_a_wrapper_is_read_through_its_text_model():
    text = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=77)
    wrapper = SimpleNamespace(layers=[1, 2, 3], args=SimpleNamespace(text_config=text))
    assert model_shape.model_kv_shape(wrapper) == (3, 2, 16) and model_shape.vocab_size(wrapper) == 77
    inner = SimpleNamespace(args=SimpleNamespace(num_attention_heads=4, num_key_value_heads=4, hidden_size=128))
    vlm = SimpleNamespace(layers=[1], args=SimpleNamespace(text_config={}, vocab_size=9), language_model=inner)
    assert model_shape.text_args(vlm) is inner.args
    assert model_shape.model_kv_shape(vlm) == (1, 4, 32) and model_shape.vocab_size(vlm) == 9  # the top's first
    # a real hybrid checkpoint's model as mlx_lm builds it from its config.json (qwen3_5: a text_config)
    module = importlib.import_module("mlx_lm.models.qwen3_5")
    config = CONFIGS["qwen3_5"]
    model = module.Model(module.ModelArgs.from_dict(config))
    t = config["text_config"]
    assert model_shape.model_kv_shape(model) == (t["num_hidden_layers"], t["num_key_value_heads"], t["head_dim"])


def test_local_kv_heads_are_what_the_layers_hold_after_sharding():
    m = fake(num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    assert model_shape.local_kv_heads(m) == 4  # the layers say nothing: the args
    for layer in m.layers:
        layer.self_attn = SimpleNamespace(n_kv_heads=2)  # this rank's half
    assert model_shape.local_kv_heads(m) == 2 and model_shape.attention_heads(m) == (8, 4)
    with pytest.raises(ValueError, match="cannot read the KV heads of SimpleNamespace"):
        model_shape.local_kv_heads(SimpleNamespace(layers=[], args=SimpleNamespace()))
