"""Seeded random rotations for TurboQuant.

Random numbers come from ``numpy.random.default_rng(seed)`` (PCG64, platform independent), never from
MLX's RNG, so one seed gives the same rotation on every machine.

- Haar: QR of a d x d standard Gaussian matrix, columns sign-fixed by sign(diag(R)) so the result is
  exactly Haar distributed (plain QR is biased). Any d >= 1.
- Hadamard: Pi = H D / sqrt(d) with D a random ±1 diagonal and H the Hadamard matrix that
  ``mx.hadamard_transform`` applies. MLX supports d = m * 2^k with m in (1, 12, 20, 28).
- None (`KEY_ROTATION_KINDS` only): Pi = I, the model's own channels. For keys coded per channel over blocks of
  tokens, where a model's channels differ in scale and a rotation would spread one channel's error over all of
  them (Gemma 3's full-attention keys: BENCHMARKS.md, issue 55); the Lloyd-Max codebooks need the rotation.
"""
from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np

from veloxquant_mlx.validate import check_int

ROTATION_KINDS = ("haar", "hadamard")
# what the per-channel block key codecs also take (CacheOptions.key_rotation): "none" = the identity
KEY_ROTATION_KINDS = ROTATION_KINDS + ("none",)
_HADAMARD_BASES = (1, 12, 20, 28)

# Distinct sub-streams of one seed (SeedSequence entropy [seed, tag]), so Haar / Hadamard / QJL draws
# never share random numbers. Tags are non-zero: entropy [s, 0] is zero-padded to the same state as
# plain default_rng(s), which would make the rotation equal to a user's test data drawn with that seed.
_STREAM_HAAR = 0x7105_0001
_STREAM_HADAMARD = 0x7105_0002
STREAM_QJL = 0x7105_0003


def _check_d_seed(d, seed):
    check_int("d", d, 1)
    check_int("seed", seed, 0)


def hadamard_supported(d: int) -> bool:
    """Whether ``mx.hadamard_transform`` supports length d (d = m * 2^k, m in 1, 12, 20, 28)."""
    if d < 1:
        return False
    for m in _HADAMARD_BASES:
        if d % m == 0:
            q = d // m
            if q & (q - 1) == 0:
                return True
    return False


@lru_cache(maxsize=64)
def _haar_np(d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, _STREAM_HAAR])
    g = rng.standard_normal((d, d))
    q, r = np.linalg.qr(g)
    sgn = np.sign(np.diag(r))
    sgn[sgn == 0] = 1.0
    q = q * sgn[None, :]
    q.setflags(write=False)
    return q


def haar_rotation(d: int, seed: int = 0) -> mx.array:
    """``(d, d)`` float32 Haar-random orthogonal matrix Pi for ``seed``."""
    _check_d_seed(d, seed)
    return mx.array(_haar_np(int(d), int(seed)).astype(np.float32))


def hadamard_signs(d: int, seed: int = 0) -> mx.array:
    """``(d,)`` float32 random ±1 diagonal of the randomized Hadamard rotation."""
    _check_d_seed(d, seed)
    rng = np.random.default_rng([int(seed), _STREAM_HADAMARD])
    s = np.where(rng.integers(0, 2, size=int(d)) == 1, 1.0, -1.0).astype(np.float32)
    return mx.array(s)


class Rotation:
    """An orthogonal map Pi on the last axis.

    ``apply(x)`` returns ``x @ Pi^T`` (Pi times each vector), ``invert(y)`` returns ``y @ Pi``.
    Both take ``(..., d)``, compute in float32 and return float32.
    """

    def __init__(self, d: int, seed: int = 0, kind: str = "haar"):
        _check_d_seed(d, seed)
        if kind not in KEY_ROTATION_KINDS:
            raise ValueError(f"rotation kind must be one of {KEY_ROTATION_KINDS}, got {kind!r}")
        self.d, self.seed, self.kind = int(d), int(seed), kind
        if kind == "none":
            self._matrix = mx.eye(self.d, dtype=mx.float32)
        elif kind == "haar":
            pi = haar_rotation(self.d, self.seed)
            self._matrix = pi
            self._pi_t = mx.contiguous(pi.T)
        else:
            if not hadamard_supported(self.d):
                raise ValueError(
                    f"rotation='hadamard' needs d = m * 2^k with m in {_HADAMARD_BASES} "
                    f"(mx.hadamard_transform), got d={self.d}; use rotation='haar'")
            self.signs = hadamard_signs(self.d, self.seed)
            self._scale = 1.0 / math.sqrt(self.d)
            self._matrix = None
            # Sylvester matrices (m = 1) are symmetric, so H^T y is another transform; MLX's
            # 12/20/28 bases may not be, and then invert falls back to a matmul with H^T.
            q = self.d
            while q % 2 == 0:
                q //= 2
            self._symmetric = q == 1
            if not self._symmetric:
                t = mx.hadamard_transform(mx.eye(self.d), scale=1.0)
                self._symmetric = bool(mx.all(t == t.T).item())
                self._h_t = None if self._symmetric else mx.contiguous(t.T)

    @property
    def matrix(self) -> mx.array:
        """``(d, d)`` float32 Pi (rows = images of basis vectors' duals: Pi @ x rotates x)."""
        if self._matrix is None:
            # Pi^T = apply(I), so Pi = apply(I)^T
            self._matrix = mx.contiguous(self.apply(mx.eye(self.d)).T)
            mx.eval(self._matrix)  # (shared by every thread, see _shared_rotation)
        return self._matrix

    def _check(self, x, name):
        if x.shape[-1] != self.d:
            raise ValueError(f"{name} must have last dimension d={self.d}, got shape {tuple(x.shape)}")

    def apply(self, x: mx.array) -> mx.array:
        """``(..., d) -> (..., d)``: Pi x for every vector."""
        x = mx.array(x) if not isinstance(x, mx.array) else x
        self._check(x, "x")
        if x.dtype != mx.float32:  # (skipped when already float32: decode calls this twice per layer)
            x = x.astype(mx.float32)
        if self.kind == "none":
            return x
        if self.kind == "haar":
            return x @ self._pi_t
        return mx.hadamard_transform(x * self.signs, scale=self._scale)

    def invert(self, y: mx.array) -> mx.array:
        """``(..., d) -> (..., d)``: Pi^T y for every vector (inverse of apply)."""
        y = mx.array(y) if not isinstance(y, mx.array) else y
        self._check(y, "y")
        if y.dtype != mx.float32:
            y = y.astype(mx.float32)
        if self.kind == "none":
            return y
        if self.kind == "haar":
            return y @ self._matrix
        if self._symmetric:
            return mx.hadamard_transform(y, scale=self._scale) * self.signs
        return (y @ self._h_t) * (self._scale * self.signs)

    def __repr__(self):
        return f"Rotation(d={self.d}, seed={self.seed}, kind={self.kind!r})"


def make_rotation(d: int, seed: int = 0, kind: str = "haar") -> Rotation:
    """The seeded rotation of ``kind`` ("haar", "hadamard", or "none": the identity) for dimension d.

    One object per (d, seed, kind) in the process: every layer of a cache uses the same seeds, and a
    rotation is immutable, so 30 layers hold one matrix instead of 30 (they are not stored bytes).
    """
    _check_d_seed(d, seed)
    if kind not in KEY_ROTATION_KINDS:
        raise ValueError(f"rotation kind must be one of {KEY_ROTATION_KINDS}, got {kind!r}")
    return _shared_rotation(int(d), int(seed), kind)


@lru_cache(maxsize=64)
def _shared_rotation(d: int, seed: int, kind: str) -> Rotation:
    rotation = Rotation(d, seed, kind)
    # shared by every thread: evaluated now (a lazy array belongs to the stream of the thread that made it)
    mx.eval([a for a in vars(rotation).values() if isinstance(a, mx.array)])
    return rotation
