"""`CacheOptions` (veloxquant_mlx.cache.options): checked once on construction with errors that name the option,
per-layer bits, the head dims a layout takes (and what it falls back to), dict and seed-page `KVCacheConfig` round
trips. The named presets: tests/cache/test_presets.py."""
from __future__ import annotations

import dataclasses

import pytest

from veloxquant_mlx.cache.options import CacheOptions, adapted_reason
from veloxquant_mlx.compat.config import KVCacheConfig


def test_defaults_and_value_bits():
    o = CacheOptions()
    assert (o.kind, o.method, o.codec, o.k_bits, o.v_bits, o.value_bits) == ("packed", "turboquant_mse", "lloyd_max",
                                                                             4, None, 4)
    assert o.layer_options().v_bits == 4 and o.layer_options() == dataclasses.replace(o, v_bits=4)
    assert CacheOptions(k_bits=3, v_bits=2).value_bits == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.k_bits = 2


@pytest.mark.parametrize("options,exc,message", [
    (dict(codec="affine", k_bits=7), ValueError, r"k_bits must be one of \(2, 3, 4, 5, 6, 8\) with this codec, got 7"),
    (dict(k_bits="4"), TypeError, "k_bits must be an int or a list of ints"),
    (dict(k_bits=True), TypeError, "k_bits must be an int"),
    (dict(k_bits=[]), ValueError, "non-empty list"),
    (dict(k_bits=[4, 9]), ValueError, r"k_bits\[1\] must be one of"),
    (dict(kind="x"), ValueError, "kind must be one of"),
    (dict(codec="nf4"), ValueError, "codec must be one of"),
    (dict(code_batch=0), ValueError, r"code_batch must be an int in 1..4096, got 0"),
    (dict(sink=-1), ValueError, "sink"),
    (dict(center_keys=1), TypeError, "center_keys must be a bool"),
    (dict(rotation="qr"), ValueError, "rotation must be one of"),
    (dict(rotation="none"), ValueError, r"rotation must be one of \('haar', 'hadamard'\)"),
    (dict(codec="affine_block", key_rotation="qr"), ValueError,
     r"key_rotation must be one of \('haar', 'hadamard', 'none'\)"),
    (dict(codec="affine_block", key_rotation=[]), ValueError, "key_rotation must be a str or a non-empty list"),
    (dict(codec="affine_block", key_rotation=["none", 1]), ValueError, r"key_rotation\[1\] must be one of"),
    (dict(key_rotation="none"), ValueError, "key_rotation applies to the codecs that code keys per channel over "
                                            r"blocks \('affine_block', .*not codec='lloyd_max'"),
    (dict(kind="rvq", sink=2), ValueError, "kind='rvq' keeps values in float16"),
    (dict(jl_dim=8), ValueError, "jl_dim .* applies only to method='turboquant_prod'"),
    (dict(group_size=32), ValueError, "group_size applies only to the affine codecs, not codec='lloyd_max'"),
    (dict(codec="affine", group_size=16), ValueError, r"group_size must be None or one of \(32, 64, 128\)"),
    (dict(codec="affine", n_outlier_channels=4), ValueError, "codec='affine' has no outlier channels"),
    (dict(channel_log2=(((0,),), ((0,),))), ValueError, "calibration_id and channel_log2 come together"),
    (dict(calibration_id="c", channel_log2=(((4,),), ((0,),))), ValueError, r"ints in \[-3, 3\]"),
    (dict(calibration_id="c", channel_log2=(((0, 0),), ((0, 0),)), head_dim=4), ValueError,
     "channel_log2 holds 2 channels per head, but head_dim=4"),
    (dict(calibration_id="c", channel_log2=(((0,),), ((0,),)), kind="rvq"), ValueError, "kind='packed' only"),
])
def test_bad_options_are_named(options, exc, message):
    with pytest.raises(exc, match=message):
        CacheOptions(**options)


def test_lists_become_tuples_and_layers_pick_their_bits():
    o = CacheOptions(k_bits=[2, 3, 4], v_bits=4, calibration_id="c", channel_log2=[[[1, -1]], [[0, 2]]])
    assert o.k_bits == (2, 3, 4) and o.channel_log2 == (((1, -1),), ((0, 2),))
    layer = o.for_layer(1, 3, head_dim=2)
    assert (layer.k_bits, layer.v_bits, layer.head_dim) == (3, 4, 2)
    assert CacheOptions().for_layer(0, 5) == CacheOptions()  # (nothing to pick: the same options)
    with pytest.raises(ValueError, match="k_bits has 3 entries, but the model has 2 layers"):
        o.for_layer(0, 2)
    with pytest.raises(ValueError, match="head_dim=64, but the model's attention head_dim is 80"):
        CacheOptions(head_dim=64).for_layer(0, 1, head_dim=80)
    with pytest.raises(ValueError, match="hold one value per layer"):
        o.layer_options()
    r = CacheOptions(codec="affine_block", key_rotation=["none", "haar"])
    assert r.key_rotation == ("none", "haar") and r.for_layer(0, 2).key_rotation == "none"
    assert r.for_layer(1, 2).layer_options().key_rotation == "haar"
    assert CacheOptions.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError, match="key_rotation has 2 entries, but the model has 3 layers"):
        r.for_layer(0, 3)
    with pytest.raises(ValueError, match="hold one value per layer"):
        r.layer_options()
    # a head dim the block keys cannot take: Lloyd-Max codes, which need their rotation
    assert CacheOptions(codec="affine_block", k_bits=8, key_rotation="none").for_dims(80, 80).key_rotation is None
    with pytest.raises(ValueError, match="describes one layer"):
        o.kv_config()


@pytest.mark.parametrize("options,dims,codec,group_size,reason", [
    (dict(codec="affine_block", k_bits=8, v_bits=4), (64, 64), "affine_block", None, None),
    (dict(codec="affine", k_bits=4, group_size=64), (96, 96), "affine", None,
     "head_dim 96: group_size 64 does not divide it, the layout's default used"),
    (dict(codec="affine_block", k_bits=8, v_bits=4), (80, 80), "lloyd_max", None,
     "head_dim 80: codec 'affine_block' cannot take it, coded with 'lloyd_max' at the same bits"),
    (dict(codec="affine", k_bits=5), (64, 80), "lloyd_max", None, "key / value dims 64 / 80: codec 'affine'"),
])
def test_for_dims_keeps_what_fits_and_says_what_it_changed(options, dims, codec, group_size, reason):
    o = CacheOptions(**options).layer_options()
    adapted = o.for_dims(*dims)
    assert (adapted.codec, adapted.group_size, adapted.k_bits, adapted.value_bits) == \
        (codec, group_size, o.k_bits, o.value_bits)
    why = adapted_reason(o, adapted, *dims)
    assert why is None if reason is None else why.startswith(reason)
    if reason is None:
        assert adapted is o


def test_dict_round_trip_and_unknown_names():
    o = CacheOptions(codec="affine", k_bits=[4, 8], v_bits=4, sink=2, recent=3, group_size=32, seed=5)
    d = o.to_dict()
    assert d["k_bits"] == [4, 8] and d["codec"] == "affine" and set(d) == set(CacheOptions.field_names())
    assert CacheOptions.from_dict(d) == o
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bits'\]"):
        CacheOptions.from_dict({"bits": 4})
    with pytest.raises(TypeError, match="options must be a dict, got list"):
        CacheOptions.from_dict([("k_bits", 4)])


def test_the_seed_pages_config_maps_onto_the_options_and_back():
    config = KVCacheConfig(bit_width_inlier=3, v_bits=2, method="turboquant_prod", jl_dim=32, head_dim=64, seed=7)
    o = CacheOptions.from_kv_config(config, sink=4, codec="lloyd_max")
    assert (o.k_bits, o.v_bits, o.method, o.jl_dim, o.head_dim, o.seed, o.sink) == (3, 2, "turboquant_prod", 32, 64,
                                                                                     7, 4)
    back = o.kv_config()
    assert (back.bit_width_inlier, back.v_bits, back.method, back.jl_dim, back.seed) == (3, 2, "turboquant_prod", 32,
                                                                                          7)
    # the seed cache reads jl_dim for any method; it means nothing to MSE, so it is dropped
    assert CacheOptions.from_kv_config(KVCacheConfig(bit_width_inlier=4, jl_dim=16)).jl_dim is None
    with pytest.raises(TypeError, match="config must be a KVCacheConfig, got dict"):
        CacheOptions.from_kv_config({"bit_width_inlier": 4})
