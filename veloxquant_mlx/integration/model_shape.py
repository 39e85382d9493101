"""The attention shape of an mlx_lm model: layers, KV heads, head_dim. The one place that reads it.

Read from ``model.args`` (mlx_lm's ``ModelArgs``: ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
``hidden_size``; a multimodal or hybrid wrapper's text model args, see `text_args`) and, for the heads a rank
really holds after tensor-parallel sharding, from the layers' attention modules (``n_kv_heads``). Used by the cache
builder (:mod:`veloxquant_mlx.integration`), the evaluation's memory measurements and the distributed helpers.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Tuple


def _positive_int(value) -> Optional[int]:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        return None
    value = int(value)
    return value if value > 0 else None


def text_args(model):
    """The args that state the text model's attention shape: ``model.args``, or for a wrapper whose top-level
    args only hold a ``text_config`` (qwen3_5, qwen2_vl, mistral3, llama4...: multimodal or hybrid checkpoints
    as mlx_lm loads them) its language model's args, else that ``text_config`` itself."""
    args = getattr(model, "args", None)
    if args is None or getattr(args, "num_attention_heads", None) is not None:
        return args
    inner = getattr(getattr(model, "language_model", None), "args", None)
    if inner is not None and getattr(inner, "num_attention_heads", None) is not None:
        return inner
    text = getattr(args, "text_config", None)
    if isinstance(text, dict) and text.get("num_attention_heads") is not None:
        return SimpleNamespace(**text)
    if text is not None and getattr(text, "num_attention_heads", None) is not None:
        return text
    return args


def vocab_size(model) -> Optional[int]:
    """The vocabulary size the model's args state (its text model's for a wrapper), else None."""
    n = _positive_int(getattr(getattr(model, "args", None), "vocab_size", None))
    return n if n is not None else _positive_int(getattr(text_args(model), "vocab_size", None))


def attention_heads(model) -> Tuple[Optional[int], Optional[int]]:
    """``(query heads, KV heads)`` from the model's args (`text_args`; KV heads default to the query heads);
    None where unknown."""
    args = text_args(model)
    heads = _positive_int(getattr(args, "num_attention_heads", None))
    kv = _positive_int(getattr(args, "num_key_value_heads", None)) or heads
    return heads, kv


def head_dim(model) -> Optional[int]:
    """head_dim from the model's args (`text_args`): an explicit ``head_dim``, else ``hidden_size //
    num_attention_heads`` when it divides; None when the model says neither."""
    args = text_args(model)
    explicit = _positive_int(getattr(args, "head_dim", None))
    if explicit is not None:
        return explicit
    hidden, heads = _positive_int(getattr(args, "hidden_size", None)), attention_heads(model)[0]
    if hidden is not None and heads is not None and hidden % heads == 0:
        return hidden // heads
    return None


def local_kv_heads(model) -> int:
    """KV heads this rank's layers hold: the attention modules' ``n_kv_heads`` (after tensor-parallel sharding,
    this rank's share), else ``model.args``'."""
    for layer in getattr(model, "layers", None) or []:
        attn = getattr(layer, "self_attn", None)
        n = _positive_int(getattr(attn, "n_kv_heads", None))
        if n is not None:
            return n
    kv = attention_heads(model)[1]
    if kv is None:
        raise ValueError(f"cannot read the KV heads of {type(model).__name__}: no model.args.num_attention_heads")
    return kv


def model_kv_shape(model) -> Tuple[int, int, int]:
    """``(n_layers, kv_heads, head_dim)`` of an mlx_lm model, from ``model.args`` (ValueError when it lacks them)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} is not an mlx_lm model: it has no .layers")
    kv, dim = attention_heads(model)[1], head_dim(model)
    if kv is None or dim is None:
        raise ValueError(f"cannot read the attention shape of {type(model).__name__} from model.args "
                         "(num_attention_heads, num_key_value_heads, head_dim / hidden_size)")
    return len(layers), kv, dim
