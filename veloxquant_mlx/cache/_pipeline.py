"""The ``keys`` attribute mlx_lm's pipeline-parallel models write on a cache, for caches that store no ``keys``.

mlx_lm's pipeline code ends a rank's forward pass with ``cache[-1].keys = mx.depends(cache[-1].keys, h)`` (the
send of ``h`` must happen before the next step reads this cache). `PipelineDependency` holds that dependency and
the next update depends on it.
"""
from __future__ import annotations

import mlx.core as mx


class PipelineDependency:
    """Mixin: ``keys`` holds the pipeline's dependency; `_after_dependency` makes an update wait for it."""

    _dependency = None

    @property
    def keys(self):
        return mx.array(0.0) if self._dependency is None else self._dependency

    @keys.setter
    def keys(self, value):
        self._dependency = value

    def _after_dependency(self, keys: mx.array, values: mx.array):
        """``(keys, values)``, made to depend on the pending dependency (then cleared), if any."""
        if self._dependency is None:
            return keys, values
        keys, values = mx.depends([keys, values], [self._dependency])
        self._dependency = None
        return keys, values
