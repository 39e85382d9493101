"""Random keys and values fed to a cache in chunks (the saved-state and prompt-cache-file tests): ``H`` KV heads
of ``D`` channels."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

H, D = 2, 64


def _tokens(n: int, seed: int, B: int = 1):
    g = np.random.default_rng(seed)
    return tuple(mx.array(g.standard_normal((B, H, n, D)).astype(np.float32)) for _ in range(2))


def _chunks(n: int, sizes) -> list:
    out, sizes = [], list(sizes) or [n]
    while sum(out) < n:
        out.append(min(sizes[len(out) % len(sizes)], n - sum(out)))
    return out


def _feed(cache, n: int, sizes, seed: int) -> None:
    k, v = _tokens(n, seed)
    at = 0
    for c in _chunks(n, sizes):
        cache.update_and_fetch(k[:, :, at:at + c], v[:, :, at:at + c])
        at += c
