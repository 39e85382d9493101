"""Code layouts for KV caches: one file per layout, each owning its math (coding and attention on its codes).

The contract every layout implements is :class:`~veloxquant_mlx.codecs.contract.Codec`. A cache option
``codec=NAME`` picks a `CodecLayout` from `CODECS`: the key codec class and the value codec class (a layout
made for keys may pair with another for values). Adding a layout: one file here, one line in `CODECS`; the file's
classes implement `Codec` (mostly through :mod:`~veloxquant_mlx.codecs.common`'s `PerTokenLayout`: declare
``token_fields``, ``fitted_spec`` / ``fitted_from`` if anything is fitted, and the coding and attention members)
and declare ``BITS``, ``OUTLIERS``, ``GROUP_SIZES`` and ``BLOCKED`` (`CodecLayout`; options are validated on them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence

import mlx.core as mx
import numpy as np

from veloxquant_mlx.codecs.affine import AffineRotatedCodec
from veloxquant_mlx.codecs.affine_block import AffineBlockKeyCodec
from veloxquant_mlx.codecs.affine_sym import AffineSymValueCodec
from veloxquant_mlx.codecs.affine_sym_log import AffineSymLogScaleValueCodec
from veloxquant_mlx.codecs.affine_block_kv import AffineBlockKVCodec, AffineBlockKVMSECodec, LloydMaxValueCodec
from veloxquant_mlx.codecs.contract import Codec, CodeField, check_codec
from veloxquant_mlx.codecs.float16 import Float16Codec
from veloxquant_mlx.codecs.kblock_tail import TailedBlockKeyCodec, TailedSymValueCodec
from veloxquant_mlx.codecs.lloyd_max import LloydMaxCodec
from veloxquant_mlx.codecs.token_lloyd import TokenLloydCodec


@dataclass(frozen=True)
class CodecLayout:
    """The codec classes of a cache's keys and values. Each class offers ``from_options(options, role, d)``
    and the class attributes ``BITS`` (allowed bits), ``OUTLIERS`` (outlier channels supported),
    ``GROUP_SIZES`` (allowed ``group_size`` values, or None when the option does not apply) and ``BLOCKED``
    (codes whole blocks of tokens: no single-token eviction)."""

    keys: type
    values: type

    def make(self, options, k_dim: int, v_dim: int):
        """``(key codec, value codec)`` for one layer of a cache."""
        return self.keys.from_options(options, "keys", k_dim), self.values.from_options(options, "values", v_dim)


CODECS: Dict[str, CodecLayout] = {
    "lloyd_max": CodecLayout(LloydMaxCodec, LloydMaxCodec),
    "affine": CodecLayout(AffineRotatedCodec, AffineRotatedCodec),
    "affine_block": CodecLayout(AffineBlockKeyCodec, AffineRotatedCodec),
    "float16": CodecLayout(Float16Codec, Float16Codec),
    "affine_block_kv": CodecLayout(AffineBlockKVCodec, AffineBlockKVCodec),
    "affine_block_kv_mse": CodecLayout(AffineBlockKVMSECodec, AffineBlockKVMSECodec),
    "kblock_vlloyd": CodecLayout(AffineBlockKVMSECodec, LloydMaxValueCodec),
    "kblock_vsym": CodecLayout(AffineBlockKVMSECodec, AffineSymValueCodec),
    "kblock_vsym8": CodecLayout(AffineBlockKVMSECodec, AffineSymLogScaleValueCodec),
    # kblock_vsym8 with the tokens waiting for their key block stored as codes (kblock_tail.py): the budget presets
    "kblock_vsym8_pt": CodecLayout(TailedBlockKeyCodec, TailedSymValueCodec),
    # keys and values per token on Lloyd-Max levels with one-byte scales, coded on arrival (token_lloyd.py): the
    # budget presets (issue 54)
    "token_lloyd8": CodecLayout(TokenLloydCodec, TokenLloydCodec),
}


def check_codable(parts: Dict[str, Sequence[mx.array]], first: int, codec: str, block: int) -> None:
    """ValueError naming the argument (``keys`` / ``values``) when the tokens a cache is about to code per channel
    over blocks hold a non-finite value: a block's one scale and bias per channel cannot hold it alone (it would
    spread over the block, or be hidden). ``parts``: per argument, the ``(B, H, n, d)`` arrays of those tokens in
    temporal order, the first at token ``first`` of the cache. One host sync for all of them."""
    flags = [mx.all(mx.isfinite(a)) for arrays in parts.values() for a in arrays]
    if all(mx.stack(flags).tolist()):
        return
    for name, arrays in parts.items():
        rows = np.concatenate([np.array(a.astype(mx.float32)) for a in arrays], axis=2)
        bad = np.nonzero(~np.isfinite(rows).all(axis=(0, 1, 3)))[0]
        if len(bad):
            at = ", ".join(str(first + int(i)) for i in bad[:8]) + (", ..." if len(bad) > 8 else "")
            per_token = tuple(n for n, lay in CODECS.items() if not (lay.keys.BLOCKED or lay.values.BLOCKED))
            raise ValueError(
                f"{name} hold a non-finite value (inf or NaN) at token{'s' if len(bad) > 1 else ''} {at} of this "
                f"cache, which this update would code: codec={codec!r} stores {name} per channel over blocks of "
                f"{block} tokens with one scale and bias each, where a non-finite token would spread over its block "
                f"or be hidden. Non-finite {name} usually mean the model overflowed (float16 activations): run it in "
                f"bfloat16 or float32, or use a per-token codec {per_token}, which keeps such a token to itself. The "
                "cache is unchanged.")


def codec_layout(name: str) -> CodecLayout:
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"codec must be one of {tuple(CODECS)}, got {name!r}")
    return CODECS[name]


__all__ = ["AffineBlockKVCodec", "AffineBlockKVMSECodec", "AffineBlockKeyCodec", "AffineRotatedCodec",
           "AffineSymLogScaleValueCodec", "AffineSymValueCodec", "CODECS", "Codec", "CodeField", "CodecLayout",
           "Float16Codec", "LloydMaxCodec", "LloydMaxValueCodec", "TailedBlockKeyCodec",
           "TailedSymValueCodec", "check_codable", "check_codec", "codec_layout"]
