"""Lloyd-Max scalar codebooks for TurboQuant.

A Lloyd-Max quantizer is 1-D continuous k-means: centroids are the conditional means of their
cells and decision boundaries are the midpoints between neighbouring centroids. We solve it for

- ``"beta"``: one coordinate of a uniformly random unit vector in R^d, density
  ``f(x) ∝ (1 - x^2)^((d-3)/2)`` on [-1, 1] (exact for TurboQuant after a Haar rotation);
- ``"gaussian"``: N(0, sigma^2) with sigma = 1/sqrt(d) (the large-d limit; RVQ stage 1), or an explicit
  ``scale`` = sigma;
- ``"laplace"``: Laplace(0, scale) (RVQ stage 2 residual).

All densities are symmetric, so the solver works on the half line [0, x_max] with 2^(b-1) cells and
mirrors the result: that halves the work and makes the codebook exactly symmetric. Cell integrals are
composite Gauss-Legendre quadrature in float64. For the Beta law we integrate in the angle
``phi = arccos(x)`` where the density becomes ``sin(phi)^(d-2)``: smooth for every d >= 2, which removes
the integrable singularity of d = 2 at x = ±1.

Results are cached per (dist, bits, d, scale) and stored as float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import mlx.core as mx
import numpy as np

DISTRIBUTIONS = ("beta", "gaussian", "laplace")

# Densities are cut where they fall below this fraction of their peak: beyond it the mass is < 1e-35.
_TAIL = 1e-40
# Composite Gauss-Legendre: each cell is split into _SUB pieces of _NODES nodes (exact for smooth
# integrands to far below float32 resolution, also for the long outer cells).
_SUB = 8
_NODES = 16
_GL_X, _GL_W = np.polynomial.legendre.leggauss(_NODES)
_TOL = 1e-13


@dataclass(frozen=True)
class Codebook:
    """A solved Lloyd-Max codebook.

    Attributes:
        dist, bits, d, scale: what it was solved for.
        centroids: ``(2^bits,)`` float32 mx.array, sorted ascending.
        boundaries: ``(2^bits - 1,)`` float32 mx.array, ``boundaries[i]`` separates cells i and i+1.
        centroids_np, boundaries_np: the same as float32 numpy arrays.
        mse: expected per-coordinate squared error E[(x - Q(x))^2] under the distribution.
        iterations: Lloyd iterations used.
    """

    dist: str
    bits: int
    d: Optional[int]
    scale: Optional[float]
    centroids_np: np.ndarray
    boundaries_np: np.ndarray
    mse: float
    iterations: int

    @property
    def centroids(self) -> mx.array:
        return _mx_cached(self, "c")

    @property
    def boundaries(self) -> mx.array:
        return _mx_cached(self, "b")

    @property
    def levels(self) -> int:
        return 1 << self.bits

    @property
    def d_mse(self) -> float:
        """Expected ||x - Q(x)||^2 for a unit vector in R^d (= d * mse); needs ``d``."""
        if self.d is None:
            raise ValueError("d_mse needs a codebook solved for a dimension d")
        return self.d * self.mse


_MX_CACHE: dict = {}


def _mx_cached(cb: Codebook, which: str) -> mx.array:
    # mx arrays built once per codebook content. Keyed by the values, not by id(cb): an unpickled or copied
    # Codebook is a new object, and once freed its id is reused by another one, which then read the first one's
    # levels (a pickled standalone cache continued with the wrong codes in ~8 % of runs of its test).
    src = cb.centroids_np if which == "c" else cb.boundaries_np
    key = (which, src.dtype.str, src.shape, src.tobytes())
    arr = _MX_CACHE.get(key)
    if arr is None:
        arr = mx.array(src, dtype=mx.float32)
        _MX_CACHE[key] = arr
    return arr


# ----------------------------------------------------------------------------------------------
# Densities on the half line, as (weight function on quadrature nodes, x at nodes)


class _HalfDensity:
    """Integrates g(x) f(x) over [lo, hi] ⊂ [0, x_max] for many cells at once."""

    def __init__(self, dist: str, d: Optional[int], scale: Optional[float]):
        self.dist = dist
        if dist == "beta":
            self.d = d
            # normaliser of sin^(d-2)(phi) on [0, pi]: sqrt(pi) Gamma((d-1)/2) / Gamma(d/2)
            self.log_z = 0.5 * math.log(math.pi) + math.lgamma((d - 1) / 2) - math.lgamma(d / 2)
            if d > 3:
                # (1 - x^2)^((d-3)/2) < _TAIL beyond x_max
                one_minus = math.exp(2.0 * math.log(_TAIL) / (d - 3))
                self.x_max = math.sqrt(max(0.0, 1.0 - one_minus)) if one_minus < 1 else 1.0
            else:
                self.x_max = 1.0
        elif dist == "gaussian":
            self.sigma = float(scale)
            self.x_max = self.sigma * math.sqrt(-2.0 * math.log(_TAIL))
        else:  # laplace
            self.s = float(scale)
            self.x_max = self.s * -math.log(_TAIL)

    def pdf(self, x: np.ndarray) -> np.ndarray:
        """Normalised density at x (x in [0, x_max]; x = 1 for Beta d=2 gives inf, never a boundary)."""
        if self.dist == "beta":
            if self.d == 3:  # uniform on [-1, 1] (avoids 0 * log 0 at x = 1)
                return np.full_like(x, math.exp(-self.log_z), dtype=np.float64)
            with np.errstate(divide="ignore"):
                return np.exp(0.5 * (self.d - 3) * np.log1p(-np.minimum(x * x, 1.0)) - self.log_z)
        if self.dist == "gaussian":
            return np.exp(-0.5 * (x / self.sigma) ** 2) / (self.sigma * math.sqrt(2 * math.pi))
        return np.exp(-np.abs(x) / self.s) / (2.0 * self.s)

    def log_pdf_unnorm(self, x: np.ndarray) -> np.ndarray:
        """log of the unnormalised density at x in [0, x_max) (for the initial guess only)."""
        if self.dist == "beta":
            return 0.5 * (self.d - 3) * np.log1p(-np.minimum(x * x, 1 - 1e-16))
        if self.dist == "gaussian":
            return -0.5 * (x / self.sigma) ** 2
        return -np.abs(x) / self.s

    def _nodes(self, lo: np.ndarray, hi: np.ndarray):
        """Quadrature nodes/weights for cells [lo_i, hi_i] in the integration variable.

        Returns x (cells, K) and w (cells, K) with sum_k w_ik g(x_ik) ≈ ∫_cell g(x) f(x) dx.
        """
        if self.dist == "beta":
            # x = cos(phi): cell [lo, hi] in x is [arccos(hi), arccos(lo)] in phi, f dx = sin^(d-2) dphi / Z
            a, b = np.arccos(np.clip(hi, -1, 1)), np.arccos(np.clip(lo, -1, 1))
        else:
            a, b = lo, hi
        edges = a[:, None] + (b - a)[:, None] * np.linspace(0.0, 1.0, _SUB + 1)[None, :]
        left, right = edges[:, :-1], edges[:, 1:]
        half = 0.5 * (right - left)
        t = (0.5 * (left + right))[..., None] + half[..., None] * _GL_X  # (cells, SUB, NODES)
        w = half[..., None] * _GL_W
        t = t.reshape(len(lo), -1)
        w = w.reshape(len(lo), -1)
        if self.dist == "beta":
            with np.errstate(divide="ignore"):
                log_s = np.log(np.sin(t))
            dens = np.exp((self.d - 2) * log_s - self.log_z) if self.d > 2 else np.full_like(t, math.exp(-self.log_z))
            return np.cos(t), w * dens
        if self.dist == "gaussian":
            dens = np.exp(-0.5 * (t / self.sigma) ** 2) / (self.sigma * math.sqrt(2 * math.pi))
        else:
            dens = np.exp(-np.abs(t) / self.s) / (2.0 * self.s)
        return t, w * dens


def _centroids(dens: "_HalfDensity", t: np.ndarray):
    """Cell masses and conditional means on [0, x_max] for interior boundaries t."""
    bnd = np.concatenate([[0.0], t, [dens.x_max]])
    x, w = dens._nodes(bnd[:-1], bnd[1:])
    p = w.sum(axis=1)
    m1 = (w * x).sum(axis=1)
    c = np.where(p > 0, m1 / np.maximum(p, 1e-300), 0.5 * (bnd[:-1] + bnd[1:]))
    return c, np.maximum(p, 1e-300), bnd


def _solve(dens: _HalfDensity, bits: int):
    """Lloyd-Max on the half line; returns full (mirrored) centroids, boundaries, mse, iterations."""
    k = 1 << (bits - 1)  # cells on [0, x_max]
    x_max = dens.x_max
    # Initial centroids: quantiles of f^(1/3) (the asymptotically optimal point density), which puts
    # the start close to the optimum so plain Lloyd converges in few iterations.
    grid = (np.arange(20000) + 0.5) / 20000 * x_max
    f13 = dens.log_pdf_unnorm(grid) / 3.0
    f13 = np.exp(f13 - f13.max())
    cdf = np.cumsum(f13)
    cdf /= cdf[-1]
    c = np.interp((np.arange(k) + 0.5) / k, cdf, grid)
    # A few Lloyd steps, then Newton on the fixed-point equations t_j = (c_{j-1} + c_j) / 2 for the
    # interior boundaries (tridiagonal Jacobian): plain Lloyd needs ~10^4 iterations at 7-8 bits.
    t = 0.5 * (c[:-1] + c[1:])
    it = 0
    for it in range(1, 11):
        c, _, _ = _centroids(dens, t)
        t = 0.5 * (c[:-1] + c[1:])
    if k > 1:
        for it in range(it + 1, it + 200):
            c, p, _ = _centroids(dens, t)
            g = t - 0.5 * (c[:-1] + c[1:])
            if np.max(np.abs(g)) <= _TOL * x_max:
                break
            bnd = np.concatenate([[0.0], t, [x_max]])
            f = dens.pdf(bnd)
            dhi = f[1:] * (bnd[1:] - c) / p  # d c_i / d t_{i+1}
            dlo = f[:-1] * (c - bnd[:-1]) / p  # d c_i / d t_i
            jac = np.diag(1.0 - 0.5 * (dhi[:-1] + dlo[1:]))
            jac -= np.diag(0.5 * dlo[1:-1], -1) if k > 2 else 0.0
            jac -= np.diag(0.5 * dhi[1:-1], 1) if k > 2 else 0.0
            step = np.linalg.solve(jac, g)
            lam = 1.0
            while lam > 1e-6:  # damp until the boundaries stay ordered inside (0, x_max)
                t_new = t - lam * step
                ok = np.all(np.diff(np.concatenate([[0.0], t_new, [x_max]])) > 0)
                if ok:
                    break
                lam *= 0.5
            if not ok:  # Newton lost: fall back to Lloyd steps
                c, _, _ = _centroids(dens, t)
                t = 0.5 * (c[:-1] + c[1:])
            else:
                t = t_new
    c, _, _ = _centroids(dens, t)
    bnd = np.concatenate([[0.0], 0.5 * (c[:-1] + c[1:]), [x_max]])
    x, w = dens._nodes(bnd[:-1], bnd[1:])
    half_mse = (w * (x - c[:, None]) ** 2).sum()
    full_c = np.concatenate([-c[::-1], c])
    full_b = np.concatenate([-(bnd[1:-1][::-1]), [0.0], bnd[1:-1]])
    return full_c, full_b, float(2.0 * half_mse), it


def _check_args(dist, bits, d, scale):
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    if d is not None and (isinstance(d, bool) or not isinstance(d, (int, np.integer))):
        raise TypeError(f"d must be an int or None, got {type(d).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not (math.isfinite(float(scale)) and float(scale) > 0):
            raise ValueError(f"scale must be a finite float > 0, got {scale!r}")
    if dist == "beta":
        if d is None or int(d) < 2:
            raise ValueError(f"dist='beta' needs d >= 2 (the density (1-x^2)^((d-3)/2)), got d={d!r}")
    if dist == "laplace" and scale is None:
        raise ValueError("dist='laplace' needs scale (the Laplace b parameter)")
    if dist == "gaussian" and d is not None and int(d) < 1:
        raise ValueError(f"d must be >= 1 for dist='gaussian', got {d!r}")


def lloyd_max_codebook(dist: str, bits: int, d: Optional[int] = None, scale: Optional[float] = None) -> Codebook:
    """The Lloyd-Max codebook with 2^bits levels for ``dist`` (cached).

    ``beta`` needs ``d``; ``gaussian`` uses sigma = ``scale`` if given, else 1/sqrt(d), else 1;
    ``laplace`` needs ``scale``.
    """
    _check_args(dist, bits, d, scale)
    return _cached_codebook(dist, int(bits), None if d is None else int(d),
                            None if scale is None else float(scale))


@lru_cache(maxsize=None)
def _cached_codebook(dist: str, bits: int, d: Optional[int], scale: Optional[float]) -> Codebook:
    if dist == "gaussian":
        sigma = scale if scale is not None else (1.0 / math.sqrt(d) if d is not None else 1.0)
        dens = _HalfDensity("gaussian", d, sigma)
    elif dist == "laplace":
        dens = _HalfDensity("laplace", d, scale)
    else:
        dens = _HalfDensity("beta", d, None)
    c, b, mse, iters = _solve(dens, bits)
    c32, b32 = c.astype(np.float32), b.astype(np.float32)
    c32.setflags(write=False)
    b32.setflags(write=False)
    return Codebook(dist, bits, d, scale, c32, b32, mse, iters)


def mean_abs_residual(cb: Codebook, dist: str = "gaussian", d: Optional[int] = None,
                      scale: Optional[float] = None) -> float:
    """E|x - Q(x)| for x from ``dist`` (defaults to the codebook's own law), by quadrature.

    Used to fit the RVQ stage-2 Laplace scale deterministically: a Laplace(0, s) has E|r| = s.
    """
    d = cb.d if d is None else d
    if dist == "gaussian":
        sigma = scale if scale is not None else (cb.scale if cb.scale is not None else 1.0 / math.sqrt(d))
        dens = _HalfDensity("gaussian", d, sigma)
    elif dist == "laplace":
        dens = _HalfDensity("laplace", d, scale if scale is not None else cb.scale)
    else:
        dens = _HalfDensity("beta", d, None)
    c = cb.centroids_np.astype(np.float64)
    half_c = c[len(c) // 2:]
    inner = cb.boundaries_np.astype(np.float64)[len(c) // 2:]  # positive boundaries
    bnd = np.concatenate([[0.0], inner, [dens.x_max]])
    bnd = np.minimum(bnd, dens.x_max)
    x, w = dens._nodes(bnd[:-1], bnd[1:])
    return float(2.0 * (w * np.abs(x - half_c[:, None])).sum())


def quantize_to_codebook(x: mx.array, cb: Codebook) -> mx.array:
    """Index of the nearest centroid for every element of ``x`` (any shape) -> uint8, same shape.

    Index = number of boundaries strictly below x. For up to 4 bits this is one broadcast compare
    and sum; for more bits a branch-free binary search (bits steps) keeps memory at O(x.size).
    """
    bnd = cb.boundaries
    if cb.bits <= 4:
        return mx.sum(x[..., None] > bnd, axis=-1).astype(mx.uint8)
    idx = mx.zeros(x.shape, dtype=mx.int32)
    step = 1 << (cb.bits - 1)
    while step >= 1:  # loop over the bits of the index (<= 8 steps), not over data
        cand = idx + step
        idx = mx.where(x > mx.take(bnd, cand - 1), cand, idx)
        step >>= 1
    return idx.astype(mx.uint8)


def lower_bound_d_mse(bits: int) -> float:
    """Information-theoretic lower bound on D_mse for unit vectors at ``bits`` per coordinate: 4^-b."""
    return 4.0 ** (-bits)


# Approximate D_mse values quoted by the paper (Beta codebook, large d) for b = 1..4.
PAPER_D_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}
