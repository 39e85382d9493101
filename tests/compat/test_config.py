"""KVCacheConfig validation, deprecated options, replace and dict round trip; the outlier rule it shares."""
import dataclasses
import json
import warnings

import numpy as np
import pytest

from veloxquant_mlx.compat import config as config_mod
from veloxquant_mlx.cache import options as options_mod
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.quant.quantizers import QUANTIZERS
from veloxquant_mlx.validate import check_outlier_channels


def test_defaults_and_value_bits():
    cfg = KVCacheConfig()
    assert cfg.method == "turboquant_mse" and cfg.bit_width_inlier == 4 and cfg.head_dim is None
    assert cfg.value_bits == 4
    assert KVCacheConfig(v_bits=2).value_bits == 2
    for m in QUANTIZERS:
        assert KVCacheConfig(method=m).method == m


@pytest.mark.parametrize("kwargs,err,field", [
    ({"method": "polarquant"}, ValueError, "method"), ({"method": 3}, TypeError, "method"),
    ({"bit_width_inlier": 0}, ValueError, "bit_width_inlier"), ({"bit_width_inlier": 9}, ValueError, "bit_width_inlier"),
    ({"bit_width_inlier": 4.0}, TypeError, "bit_width_inlier"), ({"bit_width_inlier": True}, TypeError, "bit_width_inlier"),
    ({"v_bits": 0}, ValueError, "v_bits"), ({"v_bits": 9}, ValueError, "v_bits"),
    ({"head_dim": 0}, ValueError, "head_dim"), ({"head_dim": 64.0}, TypeError, "head_dim"),
    ({"head_dim": "64"}, TypeError, "head_dim"), ({"jl_dim": 0, "method": "turboquant_prod"}, ValueError, "jl_dim"),
    ({"seed": -1}, ValueError, "seed"), ({"seed": 1.5}, TypeError, "seed"),
    ({"rotation": "givens"}, ValueError, "rotation"), ({"capacity": 0}, ValueError, "capacity"),
    ({"n_outlier_channels": -1}, ValueError, "n_outlier_channels"),
    ({"head_dim": 64, "n_outlier_channels": 64}, ValueError, "n_outlier_channels"),
    ({"outlier_bits": 0}, ValueError, "outlier_bits"), ({"n_calib_tokens": 0}, ValueError, "n_calib_tokens"),
    ({"enable_outlier_two_stream": "yes"}, TypeError, "enable_outlier_two_stream"),
    ({"enable_outlier_two_stream": 1}, TypeError, "enable_outlier_two_stream"),
    ({"rotation": "hadamard", "head_dim": 72}, ValueError, "hadamard")])
def test_validation_names_field(kwargs, err, field):
    with pytest.raises(err, match=field):
        KVCacheConfig(**kwargs)


def test_numpy_int_accepted():
    cfg = KVCacheConfig(head_dim=np.int64(128), bit_width_inlier=np.int32(3))
    assert type(cfg.head_dim) is int and cfg.head_dim == 128 and cfg.bit_width_inlier == 3


def test_deprecated_options_warn_and_are_not_stored():
    for name in ("enable_vectorized_attend", "enable_fused_query_dot", "store"):
        with pytest.warns(DeprecationWarning, match=name):
            cfg = KVCacheConfig(**{name: True})
        assert name not in cfg.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KVCacheConfig(head_dim=128)  # no warning when they are not given


def test_replace_and_dict_roundtrip():
    cfg = KVCacheConfig(method="turboquant_prod", head_dim=128, bit_width_inlier=3, jl_dim=64, capacity=256,
                        rotation="hadamard")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg2 = dataclasses.replace(cfg, bit_width_inlier=2)
    assert cfg2.bit_width_inlier == 2 and cfg2.jl_dim == 64
    with pytest.raises(ValueError, match="bit_width_inlier"):
        dataclasses.replace(cfg, bit_width_inlier=0)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert KVCacheConfig.from_dict(data) == cfg
    with pytest.raises(ValueError, match="bogus"):
        KVCacheConfig.from_dict({**data, "bogus": 1})


def test_outlier_channels_one_rule_for_both_configuration_types(monkeypatch):
    """`KVCacheConfig` and `CacheOptions` check n_outlier_channels with the one function
    `validate.check_outlier_channels`: 0, or both channel groups (outliers, the others) of at least ``min_group``
    channels. The seed's standalone cache keeps outliers as int8 columns (groups of 1 will do); the packed caches
    rotate and code each group (2)."""
    assert [KVCacheConfig(head_dim=64, n_outlier_channels=n).n_outlier_channels for n in (0, 1, 63)] == [0, 1, 63]
    assert [CacheOptions(head_dim=64, n_outlier_channels=n).n_outlier_channels for n in (0, 2, 62)] == [0, 2, 62]
    for n in (1, 63):
        with pytest.raises(ValueError, match=r"n_outlier_channels must be 0 or in 2\.\.62"):
            CacheOptions(head_dim=64, n_outlier_channels=n)
    with pytest.raises(ValueError, match=r"n_outlier_channels must be 0 or in 2\.\.head_dim-2"):
        CacheOptions(n_outlier_channels=1)
    with pytest.raises(ValueError, match=r"n_outlier_channels must be 0 or in 1\.\.63"):
        KVCacheConfig(head_dim=64, n_outlier_channels=64)
    assert check_outlier_channels("n", np.int64(3), 8) == 3 and check_outlier_channels("n", 0, 1) == 0
    with pytest.raises(TypeError, match="n must be an int"):
        check_outlier_channels("n", 2.0)
    # both go through that one function
    seen = []

    def spy(name, value, head_dim=None, *, min_group=2):
        seen.append((name, min_group))
        return check_outlier_channels(name, value, head_dim, min_group=min_group)

    monkeypatch.setattr(config_mod, "check_outlier_channels", spy)
    monkeypatch.setattr(options_mod, "check_outlier_channels", spy)
    KVCacheConfig(head_dim=16, n_outlier_channels=4)
    CacheOptions(head_dim=16, n_outlier_channels=4)
    assert seen == [("KVCacheConfig.n_outlier_channels", 1), ("n_outlier_channels", 2)]
