"""Calibrated choice of outlier channels of a key stream: the seed pages' `OutlierDetector`.

Used only by the standalone :class:`~veloxquant_mlx.compat.turboquant_cache.TurboQuantKVCache` (its two-stream
keys); documented as ``veloxquant_mlx.outlier.detector`` (that path imports this module). The serving engine's outlier
channels are the ``lloyd_max`` codec's own (:mod:`veloxquant_mlx.codecs.lloyd_max`), not this class.

A few channels of LLM keys carry most of their energy. TurboQuant's error grows with the
norm of the vector it quantizes, so splitting those channels off (kept apart at int8) before
quantization lowers the error on all the others.

Statistic: the RMS of each channel, ``sqrt(mean_t x[t, j]^2)``, over the first ``n_calib``
tokens observed. Why RMS rather than mean |x|: the quantizer's mean squared error is
proportional to ``E||k_inlier||^2``, and channel ``j`` adds exactly ``E[x_j^2]`` to it, so
removing the ``n_outliers`` channels of largest RMS minimises the expected squared norm left
to the quantizer. It counts a constant offset and a large spread alike, as the error does.
"""
from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx.compat.abstractions import as_float_rows
from veloxquant_mlx.compat.constants import DEFAULT_N_CALIB_TOKENS
from veloxquant_mlx.validate import check_int


class OutlierDetector:
    """Pick the ``n_outliers`` channels of largest RMS over the first ``n_calib`` tokens.

    Args:
        n_outliers: channels to pick, ``0 <= n_outliers < d``.
        n_calib: tokens (rows) to observe before the choice is fixed, ``>= 1``.

    ``observe`` may be called with blocks of any size; only the first ``n_calib`` rows in total
    count (a block that straddles the limit contributes its leading rows). Once calibrated, the
    choice is fixed and later calls only check their input.
    """

    def __init__(self, n_outliers: int, n_calib: int = DEFAULT_N_CALIB_TOKENS) -> None:
        self.n_outliers = check_int("n_outliers", n_outliers, 0)
        self.n_calib = check_int("n_calib", n_calib, 1)
        self.reset()

    def reset(self) -> None:
        """Forget everything observed (the next rows start a new calibration)."""
        self._d: int | None = None
        self._count = 0
        self._sumsq: mx.array | None = None  # (d,) float32 running sum of squares
        self._channels: list[int] | None = None
        self._rms: np.ndarray | None = None

    @property
    def is_calibrated(self) -> bool:
        return self._channels is not None

    @property
    def n_observed(self) -> int:
        """Rows counted so far (at most ``n_calib``)."""
        return self._count

    def observe(self, x: Any) -> None:
        """Count the rows of ``x`` (``(d,)`` or ``(n, d)``, float) towards the calibration."""
        x = as_float_rows(x, "x", self._d)
        if x.ndim == 1:
            x = x[None]
        if self._d is None:
            if self.n_outliers >= x.shape[-1]:
                raise ValueError(
                    f"n_outliers must be < d={x.shape[-1]} (the channels left to quantize), "
                    f"got {self.n_outliers}"
                )
            self._d = x.shape[-1]
            self._sumsq = mx.zeros((self._d,), dtype=mx.float32)
        if self.is_calibrated:
            return
        take = min(x.shape[0], self.n_calib - self._count)
        rows = x[:take].astype(mx.float32)
        self._sumsq = self._sumsq + mx.sum(rows * rows, axis=0)
        self._count += take
        if self._count == self.n_calib:
            # Once per calibration, so the host round-trip is off the hot path.
            self._rms = np.sqrt(np.array(self._sumsq, dtype=np.float64) / self._count)
            # Stable sort: equal RMS picks the lower channel index, deterministically.
            top = np.argsort(-self._rms, kind="stable")[: self.n_outliers]
            self._channels = sorted(int(j) for j in top)

    def get_outlier_channels(self) -> np.ndarray:
        """The chosen channel indices ``(n_outliers,)`` int32, sorted ascending (a fresh copy; usable with
        ``np.setdiff1d`` and as an index, as the seed used it). RuntimeError before calibration."""
        if self._channels is None:
            raise RuntimeError(
                f"OutlierDetector is not calibrated: observed {self._count} of n_calib={self.n_calib} rows"
            )
        return np.array(self._channels, dtype=np.int32)

    def channel_rms(self) -> np.ndarray:
        """Per-channel RMS ``(d,)`` over the calibration rows (after calibration)."""
        if self._rms is None:
            raise RuntimeError("OutlierDetector is not calibrated yet")
        return self._rms.copy()

    def __repr__(self) -> str:
        state = f"channels={self._channels}" if self.is_calibrated else f"observed={self._count}"
        return f"OutlierDetector(n_outliers={self.n_outliers}, n_calib={self.n_calib}, {state})"
