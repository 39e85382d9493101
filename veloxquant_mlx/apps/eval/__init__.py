"""Evaluation harness: perplexity / KL / top-1 against the plain cache, passkey retrieval, speed, memory.

Every function takes cache *factories* (``CacheSpec.make_cache(model) -> list``), so any
mlx_lm-compatible cache can be measured. Results are plain JSON-ready dicts.
"""
from veloxquant_mlx.apps.eval.corpus import CorpusMissing, CorpusTokens, corpus_text, corpus_tokens, text_prefix
from veloxquant_mlx.apps.eval.memory import (
    bits_per_coordinate,
    cache_memory,
    cache_nbytes,
    measure_bytes_per_token,
    model_kv_shape,
    plan_context,
)
from veloxquant_mlx.apps.eval.passkey import passkey_eval, passkey_prompt
from veloxquant_mlx.apps.eval.perplexity import perplexity_eval, perplexity_full_forward, window_starts, window_tokens
from veloxquant_mlx.apps.eval.specs import CacheSpec, baseline_specs, compressed_specs, registered_specs, resolve_spec
from veloxquant_mlx.apps.eval.speed import speed_eval

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
