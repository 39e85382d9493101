"""The batch caches live in :mod:`veloxquant_mlx.cache.packed_cache` (one engine, thin faces)."""
from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache, TurboQuantBatchRotatingPackedCache  # noqa: F401
