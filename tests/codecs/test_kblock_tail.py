"""``kblock_vsym8_pt`` (`veloxquant_mlx.codecs.kblock_tail`): the provisional bit width of waiting keys, and the
tail codec a block key codec hands its cache -- the blocks' rotation, their fitted mean, one object until the
mean changes."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.codecs import CODECS
from veloxquant_mlx.codecs.kblock_tail import (TAIL_EXTRA_BITS, ProvisionalKeyCodec, TailedBlockKeyCodec,
                                               TailedSymValueCodec, provisional_bits)


@pytest.mark.parametrize("bits,extra,want", [(2, 1, 3), (3, 1, 4), (4, 1, 5), (5, 1, 6), (6, 1, 8), (8, 1, 8),
                                             (2, 2, 4), (6, 2, 8), (4, 0, 4)])
def test_provisional_bits_is_the_next_affine_width(bits, extra, want):
    assert provisional_bits(bits, extra) == want


def test_tail_codec_follows_the_block_codec():
    x = mx.array(np.random.default_rng(0).standard_normal((1, 2, 128, 64)).astype(np.float32) + 2.0)
    keys = TailedBlockKeyCodec(64, 3, 128, seed=9)
    tail = keys.tail_codec()
    assert type(tail) is ProvisionalKeyCodec and tail.bits == provisional_bits(3, TAIL_EXTRA_BITS) == 4
    assert tail.seed == 9 and bool(mx.array_equal(tail.rotation.matrix, keys.rotation.matrix))
    assert not tail.fitted and keys.tail_codec() is tail  # one object while the mean stays
    keys.fit(x)
    fitted = keys.tail_codec()
    assert fitted is not tail and fitted.fitted and fitted.mean is keys.mean
    twin = keys.with_fitted(keys.fitted_from(x[:, :, :64]))  # another mean: another tail codec
    assert twin.tail_codec().mean is twin.mean and twin.tail_codec() is not fitted
    # the waiting keys' codes are close to the keys (more bits than the blocks, centred on the blocks' mean)
    y = fitted.decode(fitted.encode(x), mx.float32)
    assert float(mx.linalg.norm(y - x) / mx.linalg.norm(x - keys.mean[None, :, None, :])) < 0.15


def test_the_layout_pairs_them():
    layout = CODECS["kblock_vsym8_pt"]
    assert layout.keys is TailedBlockKeyCodec and layout.values is TailedSymValueCodec
    assert TailedSymValueCodec.codes_tail is True and not getattr(TailedBlockKeyCodec, "codes_tail", False)
