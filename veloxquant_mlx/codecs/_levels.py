"""Packed Lloyd-Max codes <-> their float levels in fused elementwise kernels (pure MLX: `mx.compile`).

Attention on Lloyd-Max codes needs ``levels[code]`` for every stored coordinate at every step. Reading them
with MLX's gather (`mx.take`, after unpacking the bit fields through `quant.bit_pack`'s gather tables) costs about
12 ns an element on CPU; a compiled elementwise kernel that cuts the bit fields with shifts and evaluates the
levels as a polynomial of the code costs about 1 ns (`LevelDecoder`; benchmarks/probes/attention.py, BENCHMARKS.md).
`CodePacker` is the way back for encoding: index search by compares and bit packing in one kernel.
Nothing here is device specific: `mx.compile` fuses on CPU, CUDA and Metal alike (and MLX runs the same graph
unfused where it cannot compile).

Why a polynomial is exact: a symmetric codebook (every Lloyd-Max codebook of `codebooks.py` is mirrored) is an
odd function of ``u = code - c`` with ``c = (2^b - 1) / 2``, so ``levels = u * r(u^2)`` with ``r`` of degree
``2^(b-1) - 1``, solved in float64 at the 2^b codes. `level_polynomial` keeps it only when its float32 evaluation
(Estrin's scheme, as the kernel runs it) reproduces every level to `FIT_TOL` (relative to the largest): true for
b <= 4 (at most 8 coefficients, measured ~1e-7) with the Beta and Gaussian codebooks; wider codes, a table that is
not symmetric, or one the fit misses (RVQ's 4-bit Laplace stage) keep the gather path.

Layout read: the packed words are viewed as bytes; a *unit* of ``b / gcd(b, 8)`` bytes holds ``P = 8 / gcd(b, 8)``
whole codes (4 bits: 1 byte, 2 codes; 3 bits: 3 bytes, 8 codes), and code ``j`` of every unit forms *plane*
``j``: coordinates ``j, j + P, j + 2P, ...``. One compiled function writes the P planes as separate contiguous
arrays (multi-output, no broadcasting: MLX's strided broadcast loop and its concatenation each cost more than
the level arithmetic), and callers multiply each plane with the matching strided slice of the query
(``q[..., j::P]``) and interleave their small outputs.

Shapes: ``words`` ``(..., n, W)`` uint32 in `quant.bit_pack`'s layout (``W = ceil(d b / 32)``) -> ``P`` planes
``(..., n, d / P)`` float32. A compiled function is traced once per input shape (~0.4 ms a trace; shapeless
compilation ran its kernels 2-3x slower on CPU), so the token axis is padded to a multiple of `TOKEN_BUCKET`:
one trace then serves that many decode steps.
"""
from __future__ import annotations

import math
import threading
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

FIT_TOL = 1e-6  # largest level error allowed, relative to the largest level (float32 rounding is ~6e-8)
MAX_POLY_BITS = 4  # 2^(b-1) coefficients: 8 at 4 bits; at 5 bits (16) float32 misses the levels by 1e-3 (measured)
TOKEN_BUCKET = 256


def _estrin(u, coef: Sequence):
    """``u * r(u^2)``, ``r`` with coefficients ``coef`` by Estrin's scheme: pairs, then pairs of pairs (depth
    ~2 log2(len(coef)) instead of Horner's 2 len(coef)). Plain ``+`` / ``*``: the same code runs on NumPy
    float32 arrays (to check a fit) and on MLX arrays. MLX fuses an elementwise graph only to a bounded depth:
    8-coefficient Horner was split into several kernels and ran 3-4x slower (benchmarks, BENCHMARKS.md)."""
    z = u * u
    terms = list(coef)
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] * z if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
        if len(terms) > 1:
            z = z * z
    return terms[0] * u


def level_polynomial(levels, bits: int) -> Optional[Tuple[float, ...]]:
    """Coefficients ``a`` with ``levels[code] = u r(u^2)``, ``u = code - (2^bits - 1)/2``, for the ``2^bits``
    sorted, symmetric ``levels``; None when float32 evaluation does not reproduce them to `FIT_TOL`."""
    lv = np.asarray(levels, dtype=np.float64).reshape(-1)
    if not 1 <= bits <= MAX_POLY_BITS or lv.size != 1 << bits:
        return None
    top = float(np.max(np.abs(lv))) if lv.size else 0.0
    if top == 0 or not np.all(np.isfinite(lv)) or np.max(np.abs(lv + lv[::-1])) > FIT_TOL * top:
        return None
    half = lv.size // 2
    u = np.arange(lv.size) - (lv.size - 1) / 2
    coef = np.linalg.solve(np.vander(u[half:] ** 2, half, increasing=True), lv[half:] / u[half:]).astype(np.float32)
    fit = _estrin(u.astype(np.float32), [np.float32(a) for a in coef])
    if float(np.max(np.abs(fit - lv.astype(np.float32)))) > FIT_TOL * top:
        return None
    return tuple(float(a) for a in coef)


def plane_layout(bits: int, d: int) -> Optional[Tuple[int, int]]:
    """``(bytes per unit, codes per unit P)`` of ``bits``-bit codes of ``d`` coordinates, or None when ``d`` is not a
    whole number of units (then: gather path)."""
    g = math.gcd(bits, 8)
    unit_bytes, per_unit = bits // g, 8 // g
    return (unit_bytes, per_unit) if d % per_unit == 0 and unit_bytes <= 3 else None


def _units(*byte_slices: mx.array) -> mx.array:
    """Byte ``k`` of every unit ``(..., n, d/P)`` uint8 -> the units as uint32 (little endian, as packed)."""
    out = byte_slices[0].astype(mx.uint32)
    for k, b in enumerate(byte_slices[1:], 1):
        out = out | (b.astype(mx.uint32) << (8 * k))
    return out


class LevelDecoder:
    """``sum_s levels_s[codes_s]`` of one or more packed code streams of ``d`` coordinates, as planes.

    ``streams``: ``(levels (2^b,), bits)`` per stream (RVQ adds two; all of one width). `exact` is False when some
    stream's levels have no exact polynomial or ``d`` is not whole units; the caller then keeps its gather path.
    """

    def __init__(self, streams: Sequence[Tuple[np.ndarray, int]], d: int):
        self.d, self.bits = int(d), tuple(int(b) for _, b in streams)
        self.coefs = tuple(level_polynomial(lv, b) for lv, b in streams)
        layouts = {plane_layout(b, self.d) for b in self.bits}
        self.layout = layouts.pop() if len(layouts) == 1 else None
        self.exact = self.layout is not None and all(c is not None for c in self.coefs)
        self.planes = self.layout[1] if self.exact else 0  # P
        # Units of several bytes are assembled by their own small kernel: within the level kernel they would
        # take it past MLX's fusion depth (11 ops), which splits it (slower).
        self._units = mx.compile(_units) if self.exact and self.layout[0] > 1 else None
        self._levels = mx.compile(self._plane_levels) if self.exact else None
        self._lock = threading.Lock()  # tracing mutates the compiled functions' caches

    def _plane_levels(self, *units: mx.array) -> Tuple[mx.array, ...]:
        """One units array per stream -> the P planes of summed levels (float32)."""
        planes = []
        for j in range(self.planes):
            out = None
            for u, bits, coef in zip(units, self.bits, self.coefs):
                code = (u >> (bits * j)) & ((1 << bits) - 1) if self.planes > 1 else u
                v = _estrin(code.astype(mx.float32) - ((1 << bits) - 1) / 2, coef)
                out = v if out is None else out + v
            planes.append(out)
        return tuple(planes)

    def __call__(self, *words: mx.array) -> List[mx.array]:
        """``(..., n, W_s)`` uint32 per stream -> P planes ``(..., n, d / P)`` float32 (plane j: coords j::P)."""
        if not self.exact:
            raise RuntimeError("LevelDecoder has no exact polynomial for these codes: use the gather path")
        n = words[0].shape[-2]
        pad_n = -n % TOKEN_BUCKET
        unit_bytes, per_unit = self.layout
        with self._lock:
            units = []
            for w, bits in zip(words, self.bits):
                if pad_n:
                    w = mx.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, pad_n), (0, 0)])
                b = w.view(mx.uint8)[..., : self.d * bits // 8]  # (..., n', d b / 8)
                if unit_bytes > 1:
                    b = b.reshape(*b.shape[:-1], self.d // per_unit, unit_bytes)
                    b = self._units(*(b[..., k] for k in range(unit_bytes)))
                units.append(b)
            planes = self._levels(*units)
        return [pl[..., :n, :] for pl in planes] if pad_n else list(planes)


def interleave(planes: Sequence[mx.array]) -> mx.array:
    """P arrays ``(..., w)`` (plane j: coordinates j::P) -> ``(..., w P)`` in coordinate order."""
    if len(planes) == 1:
        return planes[0]
    st = mx.stack(planes, axis=-1)
    return st.reshape(*st.shape[:-2], -1)


def _balanced_sum(terms: List[mx.array]) -> mx.array:
    """Sum in a balanced tree (fusion depth log2 instead of len)."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


class CodePacker:
    """Rotated coordinates ``(..., n, d)`` float32 -> their Lloyd-Max indices, packed: the words
    ``pack(quantize_to_codebook(y, codebook), bits)`` gives, bit for bit, from one compiled kernel per unit.

    Index = the number of boundaries strictly below the value (`codebooks.quantize_to_codebook`), summed from
    compares in the kernel; the codes of a unit are shifted into place there too (same unit layout as
    `LevelDecoder`). `exact` is False when the layout does not apply (more than 4 bits, or ``d`` not whole
    units); the caller then packs with `quant.bit_pack`.
    """

    def __init__(self, boundaries: np.ndarray, bits: int, d: int):
        self.bits, self.d = int(bits), int(d)
        self.boundaries = tuple(float(b) for b in np.asarray(boundaries, dtype=np.float32).reshape(-1))
        self.layout = plane_layout(self.bits, self.d) if self.bits <= MAX_POLY_BITS else None
        self.exact = self.layout is not None and len(self.boundaries) == (1 << self.bits) - 1
        self._kernel = mx.compile(self._units) if self.exact else None
        self._lock = threading.Lock()

    def _units(self, *planes: mx.array) -> mx.array:
        """P coordinate planes ``(..., n, d/P)`` -> one unit each ``(..., n, d/P)`` (uint8, or uint32 for 3 bytes)."""
        dtype = mx.uint8 if self.layout[0] == 1 else mx.uint32
        codes = [_balanced_sum([(y > b).astype(dtype) for b in self.boundaries]) for y in planes]
        return _balanced_sum([c << (self.bits * j) if j else c for j, c in enumerate(codes)])

    def __call__(self, y: mx.array) -> mx.array:
        """``(..., n, d)`` float32 -> ``(..., n, ceil(d bits / 32))`` uint32."""
        if not self.exact:
            raise RuntimeError("CodePacker does not apply to these codes: use quant.bit_pack.pack")
        unit_bytes, per_unit = self.layout
        # No token bucket: a cache encodes a few shapes over and over (one token per decode step, its
        # prefill chunk), so each is traced once; padding one token to a bucket would code 256.
        with self._lock:
            units = self._kernel(*(y[..., j::per_unit] for j in range(per_unit)))
        if unit_bytes > 1:  # the low unit_bytes bytes of each uint32 unit, little endian, are the stream
            units = units.view(mx.uint8).reshape(*units.shape, 4)[..., :unit_bytes]
        stream = units.reshape(*units.shape[:-2], -1) if unit_bytes > 1 else units  # (..., n', d bits / 8)
        pad_bytes = -stream.shape[-1] % 4
        if pad_bytes:
            stream = mx.pad(stream, [(0, 0)] * (stream.ndim - 1) + [(0, pad_bytes)])
        return mx.contiguous(stream).view(mx.uint32)
