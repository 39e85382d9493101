"""Argument checks shared by the library: each value is checked once, where it enters, with an error that names it.

Every function returns the checked value (normalized: numpy ints become ints) or raises TypeError / ValueError
whose message names the argument and the allowed values.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import mlx.core as mx
import numpy as np

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def check_int(name: str, value, lo: Optional[int] = None, hi: Optional[int] = None, *,
              optional: bool = False) -> Optional[int]:
    """``value`` as an int in ``lo..hi`` (either bound may be None); None passes when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        kind = "an int or None" if optional else "an int"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} ({value!r})")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if hi is None:
            allowed = f">= {lo}"
        elif lo is None:
            allowed = f"<= {hi}"
        else:
            allowed = f"in {lo}..{hi}"
        raise ValueError(f"{name} must be an int {allowed}, got {v}")
    return v


def check_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return bool(value)


def check_choice(name: str, value, choices: Iterable) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_outlier_channels(name: str, value, head_dim: Optional[int] = None, *, min_group: int = 2) -> int:
    """The number of key channels coded apart as outliers: the one rule of `CacheOptions` and `KVCacheConfig`.

    ``value`` is 0 (no outlier channels) or splits ``head_dim`` into two channel groups, the ``value`` outlier
    channels and the ``head_dim - value`` others, each holding at least ``min_group`` channels: ``value`` in
    ``min_group..head_dim - min_group`` (without ``head_dim``, only the lower bound is checked). ``min_group`` is
    what the coder of a group needs: 2 where each group is rotated and coded as a vector (the packed caches'
    ``lloyd_max`` codec, `CacheOptions`), 1 where outlier channels are kept as int8 columns and the others are
    quantized over the whole head (the seed's standalone `TurboQuantKVCache`, `KVCacheConfig`).
    """
    n = check_int(name, value, 0)
    lo = check_int("min_group", min_group, 1)
    if n and (n < lo or (head_dim is not None and n > head_dim - lo)):
        top = f"head_dim-{lo}" if head_dim is None else str(head_dim - lo)
        raise ValueError(f"{name} must be 0 or in {lo}..{top} (each of the two channel groups, outliers and "
                         f"the others, needs >= {lo} channel{'s' if lo > 1 else ''}), got {n}")
    return n


def check_finite(name: str, value, lo: Optional[float] = None) -> float:
    """A finite real number (ints allowed), optionally ``> lo``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    v = float(value)
    if not math.isfinite(v) or (lo is not None and v <= lo):
        bound = f" > {lo:g}" if lo is not None else ""
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return v


def check_heads(name: str, x, d: Optional[int] = None) -> mx.array:
    """A floating ``(B, H, T, d)`` mx.array (keys, values or queries) with at least one row, head and channel
    (``T`` may be 0: callers that need tokens say so); ``d`` checked when given."""
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array of shape (B, H, T, d), got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have shape (B, H, T, d), got shape {tuple(x.shape)}")
    if 0 in (x.shape[0], x.shape[1], x.shape[3]):
        raise ValueError(f"{name} must have shape (B, H, T, d) with B, H, d >= 1 (at least one sequence, head and "
                         f"channel), got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype} (integer inputs are not KV tensors)")
    if d is not None and x.shape[-1] != d:
        raise ValueError(f"{name} has head_dim {x.shape[-1]}, but this was set up for head_dim={d}")
    return x
