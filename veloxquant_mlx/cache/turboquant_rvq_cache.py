"""The seed's `TurboQuantRVQKVCache` at its documented path; the code is
:mod:`veloxquant_mlx.compat.turboquant_rvq_cache` (the seed pages' caches live off the serving path)."""
from veloxquant_mlx.compat.turboquant_rvq_cache import TurboQuantRVQKVCache

__all__ = ["TurboQuantRVQKVCache"]
