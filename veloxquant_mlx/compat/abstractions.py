"""The interface of the standalone (research) KV caches: part of the seed API, used only by
:mod:`veloxquant_mlx.compat` (the standalone `TurboQuantKVCache` and its `OutlierDetector`).

A standalone cache stores the keys and values of one attention head, one token row at a time
or in blocks, and answers attention queries itself (``attend``). It is not the mlx_lm cache
protocol (``update_and_fetch``); the servable caches implement that one. So `KVCache` here (the
name the seed pages document) is not ``mlx_lm.models.cache.KVCache``.

Documented by the seed pages as ``veloxquant_mlx.core.abstractions`` (that path imports this module:
`veloxquant_mlx._aliases`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import mlx.core as mx
import numpy as np


class KVCache(ABC):
    """Abstract standalone KV cache of one head with head dimension ``d``.

    Shapes: keys and values are appended as ``(d,)`` or ``(n, d)``; ``attend`` takes a query
    ``(d,)`` or a block ``(m, d)`` and returns ``(d,)`` or ``(m, d)``.
    """

    @abstractmethod
    def append_key(self, k: Any) -> None:
        """Store one key ``(d,)`` or a block of keys ``(n, d)``."""

    @abstractmethod
    def append_value(self, v: Any) -> None:
        """Store the value(s) ``(d,)`` or ``(n, d)`` of keys already appended."""

    @abstractmethod
    def attend(self, q: Any) -> Any:
        """Softmax attention of ``q`` over every stored token."""

    @abstractmethod
    def memory_bytes(self) -> int:
        """Bytes stored for the live tokens."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every stored token."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of live tokens."""


def as_float_rows(x: Any, name: str, d: int | None = None) -> "mx.array":
    """Check one vector ``(d,)`` or a block of rows ``(n, d)`` and return it as an MLX array.

    The standalone caches and the outlier detector share this input contract, so they share the
    check: an ``mx.array`` or ``np.ndarray`` of a floating dtype with 1 or 2 axes whose last axis
    is ``d`` (when given). Raises TypeError/ValueError naming ``name``.
    """
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32), got {x.dtype}")
        x = mx.array(x)
    elif not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array or np.ndarray, got {type(x).__name__}")
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(f"{name} must have a floating dtype (float16/bfloat16/float32), got {x.dtype}")
    if x.ndim not in (1, 2):
        raise ValueError(f"{name} must have shape (d,) or (n, d), got shape {tuple(x.shape)}")
    if d is not None and x.shape[-1] != d:
        raise ValueError(f"{name} must have last dimension d={d}, got shape {tuple(x.shape)}")
    return x
