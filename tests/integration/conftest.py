"""Fixtures of the calibration tests: the tiny model with skewed key channels and its calibration."""
from __future__ import annotations

import pytest

import veloxquant_mlx as vq
from _calibration_helpers import _skewed_copy


@pytest.fixture(scope="module")
def skewed(tiny_model):
    return _skewed_copy(tiny_model)


@pytest.fixture(scope="module")
def calibration(skewed, random_tokens):
    return vq.calibrate(skewed, random_tokens[:600], description="random tokens 0..600")
