"""The seed pages' API (../shared/seeds), in one package with its own configuration; kept for compatibility and to
measure its quality, NOT the serving engine (that is ``codecs/`` + ``attention/`` + ``cache/`` + ``integration/``):

- `config`: `KVCacheConfig`, the seed pages' validated configuration (`CacheOptions.from_kv_config` maps it onto
  the engine's one configuration type);
- `turboquant_cache`: the standalone one-head cache `TurboQuantKVCache` (``append_key`` / ``append_value`` /
  ``attend``; its ring buffer and int8 helpers in `_ring`), on the abstract base `abstractions.KVCache` (the name the
  seed pages document: not ``mlx_lm.models.cache.KVCache``), with its `outlier.OutlierDetector` and `constants`;
- `turboquant_rvq_cache`: the seed's RVQ key cache `TurboQuantRVQKVCache` in mlx_lm's protocol (the builder builds
  it for ``kind="rvq"``; the class registry and prompt-cache files save and load it);
- `methods`: `STANDALONE_METHODS` / `SERVABLE_METHODS`.

The seed pages' import paths (``veloxquant_mlx.core.abstractions``, ``veloxquant_mlx.cache.turboquant_rvq_cache``,
``veloxquant_mlx.outlier.detector``, ``veloxquant_mlx.cache.base``, ...) import these modules, for good
(`veloxquant_mlx._aliases`). It sits above the maths and the codecs it uses and below the caches that name its
classes. Import the submodules directly: this package imports nothing.
"""
