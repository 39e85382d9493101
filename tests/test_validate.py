"""Argument checks shared by the library (`veloxquant_mlx.validate`): each returns the value normalised (numpy ints
become ints) or raises TypeError / ValueError naming the argument and what is allowed."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.validate import (FLOAT_DTYPES, check_bool, check_choice, check_finite, check_heads, check_int,
                                     check_outlier_channels)


def test_check_int():
    v = check_int("bits", np.int64(4), 1, 8)
    assert v == 4 and type(v) is int
    assert check_int("n", None, optional=True) is None and check_int("n", -5) == -5
    for value, exc, match in [
        (True, TypeError, r"bits must be an int, got bool \(True\)"),
        (4.0, TypeError, r"bits must be an int, got float \(4.0\)"),
        (None, TypeError, r"bits must be an int, got NoneType"),
        (0, ValueError, r"bits must be an int in 1..8, got 0"),
        (9, ValueError, r"bits must be an int in 1..8, got 9"),
    ]:
        with pytest.raises(exc, match=match):
            check_int("bits", value, 1, 8)
    with pytest.raises(TypeError, match=r"seed must be an int or None, got str"):
        check_int("seed", "1", optional=True)
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got -1"):
        check_int("seed", -1, 0)
    with pytest.raises(ValueError, match=r"n must be an int <= 3, got 4"):
        check_int("n", 4, hi=3)


def test_check_bool_and_choice():
    assert check_bool("center", np.bool_(False)) is False
    with pytest.raises(TypeError, match=r"center must be a bool, got int \(1\)"):
        check_bool("center", 1)
    assert check_choice("rotation", "haar", ("haar", "hadamard")) == "haar"
    with pytest.raises(ValueError, match=r"rotation must be one of \('haar', 'hadamard'\), got 'fourier'"):
        check_choice("rotation", "fourier", iter(("haar", "hadamard")))
    with pytest.raises(ValueError, match=r"got None"):
        check_choice("rotation", None, ("haar",))


def test_check_finite():
    assert check_finite("scale", 2) == 2.0 and check_finite("scale", np.float32(0.5), lo=0) == 0.5
    with pytest.raises(ValueError, match=r"scale must be a finite number > 0, got 0"):
        check_finite("scale", 0, lo=0)
    with pytest.raises(ValueError, match=r"scale must be a finite number, got nan"):
        check_finite("scale", float("nan"))
    with pytest.raises(TypeError, match=r"scale must be a number, got bool"):
        check_finite("scale", True)
    with pytest.raises(TypeError, match=r"scale must be a number, got str"):
        check_finite("scale", "1")


@pytest.mark.parametrize("value,head_dim,min_group,ok", [
    (0, 64, 2, True), (2, 64, 2, True), (62, 64, 2, True), (1, 64, 2, False), (63, 64, 2, False),
    (1, 64, 1, True), (63, 64, 1, True), (64, 64, 1, False), (1000, None, 2, True), (1, None, 2, False)])
def test_outlier_channels_split_the_head_into_two_groups(value, head_dim, min_group, ok):
    if ok:
        assert check_outlier_channels("n_outlier_channels", value, head_dim, min_group=min_group) == value
    else:
        with pytest.raises(ValueError, match=r"n_outlier_channels must be 0 or in \d+\.\.(head_dim-\d+|\d+) \(each "
                                             r"of the two channel groups, outliers and the others, needs >= \d"):
            check_outlier_channels("n_outlier_channels", value, head_dim, min_group=min_group)


def test_outlier_channels_message_names_the_bounds():
    with pytest.raises(ValueError, match=r"must be 0 or in 2\.\.62 .* needs >= 2 channels\), got 63"):
        check_outlier_channels("n", 63, 64)
    with pytest.raises(ValueError, match=r"must be 0 or in 3\.\.head_dim-3 .* needs >= 3 channels\), got 2"):
        check_outlier_channels("n", 2, None, min_group=3)
    with pytest.raises(ValueError, match=r"must be 0 or in 1\.\.7 .* needs >= 1 channel\), got 8"):
        check_outlier_channels("n", 8, 8, min_group=1)
    with pytest.raises(ValueError, match=r"n must be an int >= 0, got -1"):
        check_outlier_channels("n", -1, 8)


def test_check_heads():
    x = mx.zeros((1, 2, 0, 8), dtype=mx.bfloat16)  # no tokens yet is allowed
    assert check_heads("keys", x) is x and check_heads("keys", x, 8) is x
    assert set(FLOAT_DTYPES) == {mx.float32, mx.float16, mx.bfloat16}
    for value, exc, match in [
        (np.zeros((1, 2, 3, 8)), TypeError, r"keys must be an mx.array of shape \(B, H, T, d\), got ndarray"),
        (mx.zeros((2, 3, 8)), ValueError, r"keys must have shape \(B, H, T, d\), got shape \(2, 3, 8\)"),
        (mx.zeros((1, 0, 3, 8)), ValueError, r"with B, H, d >= 1 .*got shape \(1, 0, 3, 8\)"),
        (mx.zeros((1, 2, 3, 8), dtype=mx.int32), ValueError, r"keys must be float32, float16 or bfloat16, got "
                                                             r"mlx.core.int32"),
        (mx.zeros((1, 2, 3, 4)), ValueError, r"keys has head_dim 4, but this was set up for head_dim=8"),
    ]:
        with pytest.raises(exc, match=match):
            check_heads("keys", value, 8)
