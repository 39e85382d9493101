"""The seed pages' caches, kept for their documented API and to measure their quality; off the serving path.

- :class:`~veloxquant_mlx.compat.turboquant_cache.TurboQuantKVCache`: the standalone one-head cache
  (``append_key`` / ``append_value`` / ``attend``), documented as ``veloxquant_mlx.cache.turboquant_cache``;
- :class:`~veloxquant_mlx.compat.turboquant_rvq_cache.TurboQuantRVQKVCache`: the seed's RVQ key cache in
  mlx_lm's protocol, documented as ``veloxquant_mlx.cache.turboquant_rvq_cache``.

The documented modules import the classes from here. Import the submodules directly: this package imports
nothing, so ``import veloxquant_mlx.compat`` costs nothing.
"""
