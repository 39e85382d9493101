"""The cache builder's former home: `KVCacheBuilder`, `make_prompt_cache` and `attention_is_routable` are
:mod:`veloxquant_mlx.integration` (with everything else that touches mlx_lm). Import them from there, or from
``veloxquant_mlx`` / ``veloxquant_mlx.cache``; these names stay importable here for existing code."""
from veloxquant_mlx.integration import KVCacheBuilder, attention_is_routable, make_prompt_cache

__all__ = ["KVCacheBuilder", "attention_is_routable", "make_prompt_cache"]
