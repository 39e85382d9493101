"""Which TurboQuant methods each kind of cache offers.

- Servable caches implement mlx_lm's cache protocol (``update_and_fetch`` and friends) and plug
  into ``mlx_lm.generate``, the server and prompt-cache files.
- Standalone methods are offered by the research cache
  :class:`veloxquant_mlx.cache.turboquant_cache.TurboQuantKVCache` (``append_key`` / ``append_value`` /
  ``attend``; its code is in :mod:`veloxquant_mlx.compat`), which does not implement the mlx_lm protocol.
"""
from __future__ import annotations

from veloxquant_mlx.compat.turboquant_cache import STANDALONE_METHODS
from veloxquant_mlx.options import METHODS

__all__ = ["SERVABLE_METHODS", "STANDALONE_METHODS"]

SERVABLE_METHODS = frozenset(METHODS)
