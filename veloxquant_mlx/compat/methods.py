"""Which TurboQuant methods each kind of cache offers (the seed pages' ``veloxquant_mlx.cache.base``).

- Servable caches implement mlx_lm's cache protocol (``update_and_fetch`` and friends) and plug
  into ``mlx_lm.generate``, the server and prompt-cache files: every quantizer (`QUANTIZERS`).
- Standalone methods are offered by the research cache `TurboQuantKVCache` (``append_key`` / ``append_value`` /
  ``attend``, :mod:`veloxquant_mlx.compat.turboquant_cache`), which does not implement the mlx_lm protocol.
"""
from __future__ import annotations

from veloxquant_mlx.compat.turboquant_cache import STANDALONE_METHODS
from veloxquant_mlx.quant.quantizers import QUANTIZERS

__all__ = ["SERVABLE_METHODS", "STANDALONE_METHODS"]

SERVABLE_METHODS = frozenset(QUANTIZERS)
