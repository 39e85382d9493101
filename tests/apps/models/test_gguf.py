"""llama GGUF files (`veloxquant_mlx.apps.models.gguf`): the model built from a file is the model written to it (tensor
names renamed, Q8_0 blocks dequantized as the ``gguf`` package dequantizes them or kept quantized), its arguments
read from the ``llama.*`` metadata; other architectures, damaged files and stray tensors are refused naming the file."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from veloxquant_mlx.apps.models import load_model
from veloxquant_mlx.apps.models.gguf import build_model_from_gguf, model_args_from_metadata, read_gguf

# mlx_lm llama module -> GGUF tensor name (inside blk.N.), written out here independently of the loader's table
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
META = {"llama.block_count": 2, "llama.embedding_length": 64, "llama.feed_forward_length": 96,
        "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.context_length": 256}


def _gguf_name(name: str) -> str:
    if not name.startswith("model.layers."):
        return TOP_NAMES[name]
    _, _, layer, rest = name.split(".", 3)
    module, part = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{part}"


def _reference(tied: bool):
    """A tiny llama as the loader must build it: traditional RoPE (llama.cpp's row order of q and k)."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=40, head_dim=16, max_position_embeddings=256,
        rope_theta=5000.0, rope_traditional=True, tie_word_embeddings=tied))
    mx.eval(model.parameters())
    return model


def _write(path, model, q8=("attn_q",), extra=None):
    """``model`` as a llama GGUF file (the ``gguf`` package's writer), the tensors named in ``q8`` as Q8_0 blocks;
    returns {GGUF name: the float32 array the file holds, dequantized as the ``gguf`` package does}."""
    import gguf
    from gguf.quants import dequantize, quantize

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in META.items():
        w.add_uint32(key, value)
    w.add_float32("llama.rope.freq_base", 5000.0)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(40)])
    held = {}
    tensors = [(_gguf_name(k), np.array(v)) for k, v in tree_flatten(model.parameters())] + list((extra or {}).items())
    for name, a in tensors:
        if name.split(".")[-2] in q8:
            codes = quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, codes, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            held[name] = dequantize(codes, gguf.GGMLQuantizationType.Q8_0).reshape(a.shape)
        else:
            w.add_tensor(name, a)
            held[name] = a
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


X = mx.array([[1, 5, 9, 3, 7, 2, 11, 30]])


@pytest.mark.parametrize("tied", [False, True])
def test_the_built_model_is_the_model_written(tmp_path, tied):
    ref = _reference(tied)
    held = _write(tmp_path / "m.gguf", ref)
    model, meta = build_model_from_gguf(tmp_path / "m.gguf")
    a = model.args
    assert (a.hidden_size, a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (
        64, 2, 4, 2, 16)
    assert (a.vocab_size, a.max_position_embeddings, a.rope_theta, a.rope_traditional) == (40, 256, 5000.0, True)
    assert a.tie_word_embeddings is tied and ("lm_head" in model) is not tied  # no output.weight: tied
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    # every tensor is the file's (Q8_0 ones as the gguf package dequantizes them), under mlx_lm's name, float32
    for name, value in tree_flatten(model.parameters()):
        assert value.dtype == mx.float32, name
        np.testing.assert_allclose(np.array(value), held[_gguf_name(name)], rtol=0, atol=1e-6, err_msg=name)
    ref.load_weights([(k, mx.array(held[_gguf_name(k)])) for k, _ in tree_flatten(ref.parameters())])
    assert float(mx.abs(model(X) - ref(X)).max()) <= 1e-5 * float(mx.abs(ref(X)).max())


def test_quantized_keeps_the_blocks_and_gives_the_same_logits(tmp_path):
    _write(tmp_path / "m.gguf", _reference(False), q8=("attn_q", "ffn_down"))
    plain, _ = build_model_from_gguf(tmp_path / "m.gguf")
    quantized, _ = build_model_from_gguf(tmp_path / "m.gguf", quantized=True)
    layer = quantized.model.layers[1]
    import mlx.nn as nn

    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear) and layer.self_attn.q_proj.bits == 8
    assert layer.self_attn.q_proj.group_size == 32 and isinstance(layer.mlp.down_proj, nn.QuantizedLinear)
    assert type(layer.self_attn.k_proj) is nn.Linear  # stored as float32: kept a plain layer
    assert layer.self_attn.q_proj.scales.dtype == mx.float32  # (the file's float16 scales, widened)
    assert float(mx.abs(quantized(X) - plain(X)).max()) <= 1e-4 * float(mx.abs(plain(X)).max())


def test_arguments_from_metadata():
    meta = {"general.architecture": "llama", **META, "tokenizer.ggml.tokens": ["a"] * 7}
    a = model_args_from_metadata(meta, tied=True)
    assert (a.head_dim, a.vocab_size, a.rms_norm_eps, a.rope_theta, a.tie_word_embeddings) == (16, 7, 1e-5, 10000.0, True)
    a = model_args_from_metadata({**meta, "llama.rope.dimension_count": 8, "llama.vocab_size": 9}, tied=False)
    assert (a.head_dim, a.vocab_size, a.num_key_value_heads) == (8, 9, 2)
    no_kv = {k: v for k, v in meta.items() if k != "llama.attention.head_count_kv"}
    assert model_args_from_metadata(no_kv, tied=True).num_key_value_heads == 4  # none stated: one per query head
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'qwen2': only 'llama' GGUF files"):
        model_args_from_metadata({**meta, "general.architecture": "qwen2"}, tied=True)


def test_missing_metadata_and_stray_tensors_are_named(tmp_path):
    import gguf

    path = tmp_path / "few.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"few\.gguf lacks the metadata key 'llama\.attention\.head_count'"):
        build_model_from_gguf(path)
    _write(tmp_path / "stray.gguf", _reference(False), extra={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match=r"stray\.gguf: unexpected GGUF tensor 'blk\.0\.attn_sinks\.weight'"):
        build_model_from_gguf(tmp_path / "stray.gguf")


def test_read_gguf_names_what_it_cannot_read(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        read_gguf(tmp_path / "none.gguf")
    _write(tmp_path / "whole.gguf", _reference(False))
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "whole.gguf").read_bytes()[:300])
    with pytest.raises(ValueError, match=r"cut\.gguf is not a readable GGUF file \(truncated, corrupt or another"):
        read_gguf(tmp_path / "cut.gguf")


def test_non_llama_gguf_is_rejected(tmp_path):
    p = tmp_path / "fake.gguf"
    mx.save_gguf(str(p), {"token_embd.weight": mx.zeros((4, 8))}, {"general.architecture": "qwen2"})
    with pytest.raises(ValueError, match="only 'llama'"):
        load_model(str(p))


def test_truncated_embedded_gguf_is_a_value_error_naming_it(tmp_path):
    from veloxquant_mlx.apps.models import load_model
    from veloxquant_mlx.apps.models.loader import ModelPackageMissing, embedded_gguf_path

    try:
        src = embedded_gguf_path()
    except ModelPackageMissing:
        pytest.skip("embedded model package not installed")
    part = tmp_path / "part.gguf"
    with open(src, "rb") as f:
        part.write_bytes(f.read(3_000_000))  # header and metadata whole, tensor data cut
    with pytest.raises(ValueError, match="part.gguf"):
        load_model(str(part))
