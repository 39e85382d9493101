"""The standalone `TurboQuantKVCache` at its documented path; the code is
:mod:`veloxquant_mlx.compat.turboquant_cache` (the seed pages' caches live off the serving path)."""
from veloxquant_mlx.compat.turboquant_cache import TurboQuantKVCache

__all__ = ["TurboQuantKVCache"]
