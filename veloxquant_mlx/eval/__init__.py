"""Evaluation harness: perplexity / KL / top-1 against the plain cache, passkey retrieval, speed, memory.

Every function takes cache *factories* (``CacheSpec.make_cache(model) -> list``), so any
mlx_lm-compatible cache can be measured. Results are plain JSON-ready dicts.
"""
from .corpus import CorpusMissing, CorpusTokens, corpus_text, corpus_tokens, text_prefix
from .memory import (
    bits_per_coordinate,
    cache_memory,
    cache_nbytes,
    measure_bytes_per_token,
    model_kv_shape,
    plan_context,
)
from .passkey import passkey_eval, passkey_prompt
from .perplexity import perplexity_eval, perplexity_full_forward, window_starts, window_tokens
from .specs import CacheSpec, baseline_specs, compressed_specs, registered_specs, resolve_spec
from .speed import speed_eval

__all__ = [
    "CacheSpec",
    "CorpusMissing",
    "CorpusTokens",
    "baseline_specs",
    "bits_per_coordinate",
    "cache_memory",
    "cache_nbytes",
    "compressed_specs",
    "corpus_text",
    "corpus_tokens",
    "measure_bytes_per_token",
    "model_kv_shape",
    "passkey_eval",
    "passkey_prompt",
    "perplexity_eval",
    "perplexity_full_forward",
    "plan_context",
    "registered_specs",
    "resolve_spec",
    "speed_eval",
    "text_prefix",
    "window_starts",
    "window_tokens",
]
