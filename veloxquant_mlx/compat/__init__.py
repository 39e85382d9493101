"""The seed pages' API, kept for compatibility (its documented import paths) and to measure its quality; NOT the
serving engine (that is ``cache/`` + ``codecs/`` + ``attention/`` + ``integration/``).

- :class:`~veloxquant_mlx.compat.turboquant_cache.TurboQuantKVCache`: the standalone one-head cache
  (``append_key`` / ``append_value`` / ``attend``), documented as ``veloxquant_mlx.cache.turboquant_cache``;
  its ring-buffer and int8 helpers in ``_ring.py``;
- :class:`~veloxquant_mlx.compat.turboquant_rvq_cache.TurboQuantRVQKVCache`: the seed's RVQ key cache in
  mlx_lm's protocol, documented as ``veloxquant_mlx.cache.turboquant_rvq_cache``. The engine still knows it by
  name: the builder builds it (``kind="rvq"``), the class registry and prompt-cache files save and
  load it;
- :class:`~veloxquant_mlx.compat.outlier.OutlierDetector`: the standalone cache's outlier-channel choice,
  documented as ``veloxquant_mlx.outlier.detector``.

The documented modules are thin re-exports of these. The seed's other helpers stay below, in ``core/``, because
this package imports ``core/context.py`` (the quantizers' `EncodedVector`, which the engine's codecs use too) and a
package one layer down cannot import back up: ``core/abstractions.py`` (the standalone caches' abstract base, named
``KVCache`` as the seed pages document it -- not mlx_lm's ``KVCache``; only this package subclasses it) and
``core/constants.py`` (its int8 and growth constants). Import the submodules directly: this package imports nothing,
so ``import veloxquant_mlx.compat`` costs nothing.
"""
