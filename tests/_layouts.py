"""Layouts the tests name: `KBLOCK`, the budget presets' block layout before issue 54 (keys per channel over
128-token blocks with their own ranges, the tokens waiting for their block exact, values per token with one-byte
scales), which the block-key features (``key_rotation``, its probe and calibration, issue 47's coded tail) still
serve."""
from __future__ import annotations

from veloxquant_mlx.cache.options import CacheOptions

KBLOCK = CacheOptions(codec="kblock_vsym8", k_bits=4, v_bits=4, group_size=128, trim_headroom=0, center_keys=False,
                      center_values=False, sink=1, window_recent=16, window_k_bits=5)
