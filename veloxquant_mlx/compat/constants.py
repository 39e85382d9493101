"""Numeric constants of the seed API's standalone cache and outlier detector (:mod:`veloxquant_mlx.compat`), in
one place; documented by the seed pages as ``veloxquant_mlx.core.constants`` (`veloxquant_mlx._aliases`)."""
from __future__ import annotations

#: Tokens the outlier detector observes before it picks the outlier channels.
DEFAULT_N_CALIB_TOKENS = 128

#: Largest int8 code of a symmetric absmax quantizer (codes lie in [-127, 127]; -128 is unused
#: so that the grid is symmetric around zero).
INT8_MAX = 127

#: Rows by which the standalone cache's buffers grow (same step as mlx_lm's KVCache).
CACHE_GROWTH_STEP = 256
