"""`Rows`: the one storage engine behind every packed cache, one module per job (each importing only the ones
listed before it):

- `row_codes`: what the codecs store: one codec's code slots of B rows (`RowCodes`), the tail (`CodedTail`) and its
  coder (`TailCoder`), both on the one slot store (`veloxquant_mlx.core.slot_store.SlotStore`),
  what a codec declares, read once per configuration (`_layouts`, its cache `_LAYOUTS`), the shared helpers;
- `row_views`: the attention parts of the rows (`attention_parts`, `part_masks`, `row_parts`: `RowViews`, a mixin
  `Rows` inherits);
- `row_policy`: `Rows` itself (the layout ``[sink | codes | tail]`` is its module docstring): counts, when to code,
  fits, eviction, trim, bytes and copies;
- `row_ops`: rows in, rows out (`take_rows`, `concat_rows`, `row_arrays`, `rows_from_arrays`,
  `batch_rows_from_arrays`).

Every name this module had when it held all of them stays importable from here (the same objects). The layouts'
cache `_LAYOUTS` lives in `row_codes` alone and is read there on every access (`__getattr__` below).
"""
from __future__ import annotations

# The names the single module had at its top (its imports) stay reachable here.
import copy  # noqa: F401
import threading  # noqa: F401
from typing import Dict, List, Optional, Sequence  # noqa: F401

import mlx.core as mx  # noqa: F401
from mlx_lm.models.cache import dynamic_roll  # noqa: F401

from veloxquant_mlx.attention.kernel import gather_rows  # noqa: F401
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart  # noqa: F401
from veloxquant_mlx.codecs import codec_layout  # noqa: F401

# The submodules, and their names (classes, functions and constants: the same objects, nothing to go stale).
from veloxquant_mlx.cache import row_codes
from veloxquant_mlx.cache.row_codes import CodedTail, RowCodes, TailCoder, _layouts, _round_up, column, fold  # noqa: F401
from veloxquant_mlx.cache.row_views import RowViews  # noqa: F401
from veloxquant_mlx.cache.row_policy import CODE_STEP, COUNTS, TAIL_STEP, Rows  # noqa: F401
from veloxquant_mlx.cache.row_ops import (_take, batch_rows_from_arrays, concat_rows, row_arrays,  # noqa: F401
                                        rows_from_arrays, take_rows)


def __getattr__(name: str):
    if name == "_LAYOUTS":  # read live: the one cache, in row_codes
        return row_codes._LAYOUTS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | {"_LAYOUTS"})
