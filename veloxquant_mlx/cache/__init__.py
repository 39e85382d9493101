"""The cache store and the servable caches (packed K and V), one module per job:

- `options`: `CacheOptions`, the one configuration of a packed cache; `presets`: its named presets and THE default;
- the store, `Rows` (a single sequence is a batch of one), one module per job, each importing only the ones before
  it: `row_codes` (one codec's code slots of B rows, `RowCodes`; the tail, `CodedTail`, and its coder, `TailCoder`;
  both on `veloxquant_mlx.quant.slot_store.SlotStore`), `row_views` (the rows' attention parts: `RowViews`, a mixin
  `Rows` inherits), `row_policy` (`Rows` itself: counts, when to code, fits, eviction, trim, bytes, copies),
  `row_ops` (rows in, rows out: `take_rows`, `concat_rows`, `row_arrays`, `rows_from_arrays`);
- the mlx_lm-facing caches, thin faces over `Rows`: `packed_cache` (single, window, batch, batch window; their
  shared base in `_face`, the batch methods in `_batch`), `chunked`;
- `saved_state` (every packed cache's saved state, checked on restore), `prompt_cache_io` (files), `registry` (the
  classes prompt-cache files name).

The builder is one layer up (`veloxquant_mlx.integration.builder`). Import each name from its module; the names
this package exported lazily until issue 57 still resolve, with a DeprecationWarning (`veloxquant_mlx._aliases`).
"""
from veloxquant_mlx import _aliases

__getattr__ = _aliases.package_getattr(__name__)
