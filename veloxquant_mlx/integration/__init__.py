"""Everything that touches mlx_lm's behaviour, in one package: compressed caches for a model, attention routed to
their codes, their classes visible to mlx_lm's loader, the calibration measured through the model. Nothing is
patched at import time.

One module per job, each importing only the ones listed before it:

- `model_shape`: layers, KV heads and head_dim of any mlx_lm model (one lookup for every user);
- `calibration`: the `Calibration` object, its file (safetensors + versioned JSON metadata) and the model
  fingerprint it is bound to;
- `routing`: attention routing (`install` / `uninstall` / `use_packed_attention` / `hold_while_alive`, the
  replacement `packed_scaled_dot_product_attention`, `routes_model`) and the routing's state (its count and lock);
- `scan`: which models the routing reaches (`attention_is_routable`, `fetches_real_arrays`, `uniform_head_dim`,
  `latent_attention`: read from the model's modules, their bytecode and syntax trees);
- `builder`: building caches (`KVCacheBuilder`, `make_prompt_cache`, `CACHE_KINDS`, `register_cache_kind`) and
  what a cache list compressed (`cache_report`, `coverage_line`);
- `enabling`: `enable` / `disable` / `is_enabled` / `enabled_options` (mlx_lm's own paths then build our caches);
- `measure_calibration`: `calibrate` (runs the model on calibration text, with attention routed).

Import each name from its module; the public ones are also ``veloxquant_mlx.NAME``. The names this package
re-exported until issue 57 still resolve, with a DeprecationWarning (`veloxquant_mlx._aliases`).
"""
from veloxquant_mlx import _aliases

__getattr__ = _aliases.package_getattr(__name__)
