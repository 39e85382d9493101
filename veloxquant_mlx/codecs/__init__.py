"""Code layouts for KV caches: one file per layout, each owning its math (coding and attention on its codes).

The contract every layout implements is :class:`~veloxquant_mlx.codecs.contract.Codec`. A cache option
``codec=NAME`` picks a `CodecLayout` from `CODECS`: the key codec class and the value codec class (a layout
made for keys may pair with another for values). Adding a layout: one file here, one line in `CODECS`; the file's
classes implement `Codec` (mostly through :mod:`~veloxquant_mlx.codecs._common`'s `PerTokenLayout`: declare
``token_fields``, ``fitted_spec`` / ``fitted_from`` if anything is fitted, and the coding and attention members)
and declare ``BITS``, ``OUTLIERS``, ``GROUP_SIZES`` and ``BLOCKED`` (`CodecLayout`; options are validated on them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from veloxquant_mlx.codecs.affine import AffineRotatedCodec
from veloxquant_mlx.codecs.affine_block import AffineBlockKeyCodec
from veloxquant_mlx.codecs.affine_sym import AffineSymValueCodec
from veloxquant_mlx.codecs.affine_block_kv import AffineBlockKVCodec, AffineBlockKVMSECodec, LloydMaxValueCodec
from veloxquant_mlx.codecs.contract import Codec, CodeField, check_codec
from veloxquant_mlx.codecs.float16 import Float16Codec
from veloxquant_mlx.codecs.lloyd_max import LloydMaxCodec


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
}


def codec_layout(name: str) -> CodecLayout:
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"codec must be one of {tuple(CODECS)}, got {name!r}")
    return CODECS[name]


__all__ = ["AffineBlockKVCodec", "AffineBlockKVMSECodec", "AffineBlockKeyCodec", "AffineRotatedCodec",
           "AffineSymValueCodec", "CODECS", "Codec", "CodeField", "CodecLayout", "Float16Codec",
           "LloydMaxCodec", "LloydMaxValueCodec", "check_codec", "codec_layout"]
