"""Build an mlx_lm llama ``Model`` from a llama-architecture GGUF file (MLX affine-quantized tensors).

``mx.load(path, return_metadata=True)`` already turns the GGUF Q4_0/Q4_1/Q8_0 blocks into MLX's
affine format (``name.weight`` packed uint32, ``name.scales``, ``name.biases``, group 32) under
the GGUF tensor names; here we only rename, dequantize (default) or keep them quantized.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.llama import Model, ModelArgs

GGUF_GROUP_SIZE = 32

# GGUF tensor name (inside blk.N.) -> mlx_lm llama module path (inside model.layers.N.)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


def _scalar(v: Any):
    """GGUF metadata scalars come back as 0-d mx.arrays; make them Python values."""
    if isinstance(v, mx.array):
        return v.item() if v.size == 1 else v.tolist()
    return v


def read_gguf(path: str | Path) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """Tensors (GGUF names) and metadata (scalars as Python values, lists kept) of a GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        weights, meta = mx.load(str(path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:  # MLX reports a malformed file as RuntimeError
        raise ValueError(f"{path} is not a readable GGUF file (truncated, corrupt or another format): {e}") from None
    return weights, {k: _scalar(v) for k, v in meta.items()}


def model_args_from_metadata(meta: Dict[str, Any], tied: bool):
    """mlx_lm ``llama.ModelArgs`` from GGUF ``llama.*`` metadata.

    ``rope_traditional=True``: llama.cpp's converter permutes the q/k projection rows from the
    HF "rotate half" layout to interleaved pairs, which is MLX's traditional RoPE.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: only 'llama' GGUF files can be loaded "
            "(use a directory with an mlx_lm model for other architectures)"
        )
    p = "llama."
    n_heads = int(meta[p + "attention.head_count"])
    hidden = int(meta[p + "embedding_length"])
    head_dim = int(meta.get(p + "rope.dimension_count", hidden // n_heads))
    vocab = meta.get(p + "vocab_size")
    if vocab is None:
        vocab = len(meta["tokenizer.ggml.tokens"])
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(meta[p + "block_count"]),
        intermediate_size=int(meta[p + "feed_forward_length"]),
        num_attention_heads=n_heads,
        num_key_value_heads=int(meta.get(p + "attention.head_count_kv", n_heads)),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=int(vocab),
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(p + "context_length", 2048)),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        rope_traditional=True,
        tie_word_embeddings=tied,
    )


def _rename(name: str) -> str:
    m = _BLK.match(name)
    if m:
        layer, kind, part = m.groups()
        if kind not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{part}"
    m = _TOP.match(name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unexpected GGUF tensor {name!r}")


def _bits(weight: mx.array, scales: mx.array) -> int:
    # packed uint32 width = in*bits/32 and scales width = in/group(32) => ratio is the bit width.
    return int(weight.shape[-1] // scales.shape[-1])


def build_model_from_gguf(path: str | Path, quantized: bool = False):
    """(model, metadata) from a llama GGUF file.

    quantized=False (default): dequantize every affine-quantized tensor to float32 once; MLX's CPU
    quantized_matmul is much slower than a float32 BLAS matmul and the logits are the same.
    quantized=True: keep ``QuantizedLinear``/``QuantizedEmbedding`` (group 32, bits as stored).
    """
    weights, meta = read_gguf(path)
    if meta.get("general.architecture") != "llama":
        raise ValueError(
            f"unsupported GGUF architecture {meta.get('general.architecture')!r} in {path}: "
            "only 'llama' GGUF files are supported"
        )
    tied = "output.weight" not in weights
    try:
        args = model_args_from_metadata(meta, tied)
    except KeyError as e:
        raise ValueError(f"GGUF file {path} lacks the metadata key {e.args[0]!r}") from None
    model = Model(args)

    try:
        renamed = {_rename(k): v for k, v in weights.items()}
    except ValueError as e:
        raise ValueError(f"GGUF file {path}: {e}") from None
    # bits of each quantized module, keyed by module path
    qbits = {}
    for k in renamed:
        if k.endswith(".scales"):
            mod = k[: -len(".scales")]
            qbits[mod] = _bits(renamed[mod + ".weight"], renamed[k])

    if quantized:
        def predicate(path_: str, module: nn.Module):
            if path_ in qbits and hasattr(module, "to_quantized"):
                return {"group_size": GGUF_GROUP_SIZE, "bits": qbits[path_]}
            return False

        nn.quantize(model, class_predicate=predicate)
        # float16 scales/biases from the file -> float32: keeps activations float32 on CPU
        final = {k: (v.astype(mx.float32) if v.dtype == mx.float16 else v) for k, v in renamed.items()}
    else:
        final = {}
        for k, v in renamed.items():
            mod = k.rsplit(".", 1)[0]
            if mod in qbits:
                if k.endswith(".weight"):
                    final[k] = mx.dequantize(
                        v,
                        renamed[mod + ".scales"].astype(mx.float32),
                        renamed[mod + ".biases"].astype(mx.float32),
                        group_size=GGUF_GROUP_SIZE,
                        bits=qbits[mod],
                    )
                continue  # scales/biases are folded into the float32 weight
            final[k] = v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
    return load_weights_checked(model, final, path, "llama"), meta


def load_weights_checked(model, weights, path, architecture: str):
    """``model`` with every one of ``weights`` (name -> array) loaded and evaluated, in eval mode; a tensor missing
    or of the wrong shape for the declared architecture is a ValueError naming the file."""
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ValueError(f"GGUF file {path} does not match its {architecture} metadata: {e}") from None
    mx.eval(model.parameters())
    model.eval()
    return model
