"""``kblock_vsym8_pt``: ``kblock_vsym8`` whose tokens waiting for their key block are stored as codes too.

``kblock_vsym8`` codes keys per rotated channel over 128-token blocks, so the newest up to 127 tokens of a cache wait
for their block; held exact (float32 on this CPU) they cost up to ~2 bits per coordinate at 2048 tokens on top of the
layout's b + 0.1875 (issue 47). This layout stores them as codes from the moment they arrive, once the cache holds
a coded block (before it, a short chat's tokens stay exact: `veloxquant_mlx.cache.row_policy.Rows.sync_tail`):

- values: per token already (symmetric, one-byte log scale per 64 coordinates): a waiting value is coded on arrival
  with the value codec itself, and its codes move unchanged into the value store when the key block completes (no
  second rounding);
- keys: a provisional per-token code (`ProvisionalKeyCodec`: the same symmetric one-byte-log-scale codes, on the
  keys' own rotation, ``TAIL_EXTRA_BITS`` more bits than the block codes, 8 at most) until the block completes;
  the block is then coded from the provisional codes' reconstruction (a second rounding: the provisional error
  adds to the block's; at ``b + 2`` bits it is ~1/16 of a ``b``-bit per-token code's, measured in BENCHMARKS.md).

A waiting key costs ``b + TAIL_EXTRA_BITS + 0.125`` bits against the block's ``b + 0.25``: with at most 127 of
them the layout stays within the ``b + 0.25`` budget at every length the budget presets are measured at (2048,
3000, 4096 tokens; `veloxquant_mlx.apps.eval.memory.measure_bits`). The cache (`veloxquant_mlx.cache.row_policy`) reads the
tail codec from the key codec (`tail_codec`); the value codec codes its own tail (`codes_tail`). The compiled
attention reads the coded tail from its codes in the same call as the blocks (`veloxquant_mlx.attention.kernel`).
"""
from __future__ import annotations

from veloxquant_mlx.codecs.affine import AFFINE_BITS
from veloxquant_mlx.codecs.affine_block_kv import AffineBlockKVMSECodec
from veloxquant_mlx.codecs.affine_sym_log import AffineSymLogScaleValueCodec

TAIL_EXTRA_BITS = 1  # provisional key codes: this many bits more than the block codes (8 at most)


def provisional_bits(bits: int, extra: int) -> int:
    """The smallest affine bit width >= ``bits + extra`` (8 at most)."""
    want = min(bits + extra, 8)
    return min(b for b in AFFINE_BITS if b >= want)


class ProvisionalKeyCodec(AffineSymLogScaleValueCodec):
    """Per-token codes of keys waiting for their block (symmetric, one-byte log scales per 64 coordinates)."""


class TailedBlockKeyCodec(AffineBlockKVMSECodec):
    """`AffineBlockKVMSECodec` keys whose waiting tokens are stored as provisional per-token codes (`tail_codec`)."""

    TAIL_EXTRA_BITS = TAIL_EXTRA_BITS
    # The mixing rotation of the per-token provisional codes when the block keys are coded in the model's own
    # channels (``key_rotation="none"``); `from_options` sets the options' ``rotation``.
    tail_rotation = "haar"

    @classmethod
    def from_options(cls, options, role: str, d: int):
        codec = super().from_options(options, role, d)
        codec.tail_rotation = options.rotation
        return codec

    def tail_codec(self) -> ProvisionalKeyCodec:
        """The codec of this layer's waiting keys: the blocks' seed and rotation — a mixing rotation even where the
        block keys are unrotated (per-channel block codes can do without one, per-token codes cannot: Gemma 3's
        full-attention layers, KL 0.021 -> 0.007 on the Debian text, issue 54) — and, when the blocks are
        centred, their fitted per-head mean (``(H, d)``, or ``(B*H, d)`` folded): per-token codes of centred keys
        spend their levels on what varies between tokens, not on the channels' common offset (2-2.4x lower
        squared error at the same bits on SmolLM2's keys in most layers)."""
        hit = getattr(self, "_tail_codec", None)  # (mean, codec): `with_fitted` copies attributes, so check it
        if hit is None or hit[0] is not self.mean:
            rotation = self.tail_rotation if self.rotation_kind == "none" else self.rotation_kind
            codec = ProvisionalKeyCodec(self.d, provisional_bits(self.bits, self.TAIL_EXTRA_BITS), seed=self.seed,
                                        rotation=rotation, center=self.center)
            if self.mean is not None:
                codec = codec.with_fitted({"mean": self.mean})
            hit = self._tail_codec = (self.mean, codec)
        return hit[1]


class TailedSymValueCodec(AffineSymLogScaleValueCodec):
    """`AffineSymLogScaleValueCodec` values whose waiting tokens are coded on arrival by this same codec."""

    codes_tail = True


__all__ = ["ProvisionalKeyCodec", "TAIL_EXTRA_BITS", "TailedBlockKeyCodec", "TailedSymValueCodec",
           "provisional_bits"]
