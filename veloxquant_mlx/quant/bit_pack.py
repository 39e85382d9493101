"""Pack b-bit codes (b = 1..8) into uint32 words along the last axis.

Layout: each row ``(..., n)`` is one LSB-first bit stream (value j occupies stream bits
[j*b, (j+1)*b), stream bit i is bit i % 32 of word i // 32), padded with zeros to whole words:
``(..., ceil(n*b/32))`` uint32. This is the layout of ``mx.quantize``'s packed weights, including
the 3/5/6-bit widths where values straddle word boundaries.

Vectorized: a row is cut into groups of g = 32 / gcd(32, b) values that fill exactly w = g*b/32
words. Precomputed tables say, for every word of a group, which values touch it and by how much to
shift them; packing is then one gather, shifts and a sum (the bit fields are disjoint, so sum == or).

`BitPackBuffer` is the seed's byte layout of the same stream: ``(..., ceil(n*b/8))`` uint8, stream bit i
is bit i % 8 of byte i // 8. Those bytes are the little-endian bytes of the words, cut to whole bytes, so
it reuses `pack` / `unpack` and a reinterpreting view.
"""
from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np


def _check_bits(bits):
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 8:
        raise ValueError(f"bits must be an int in 1..8, got {bits!r}")
    return int(bits)


def packed_words(n: int, bits: int) -> int:
    """Number of uint32 words holding n codes of ``bits`` bits: ceil(n * bits / 32)."""
    bits = _check_bits(bits)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return (int(n) * bits + 31) // 32


@lru_cache(maxsize=None)
def _tables(bits: int):
    """Per-bit-width gather/shift tables (as mx arrays)."""
    g = 32 // math.gcd(32, bits)  # values per group
    w = g * bits // 32  # words per group
    # pack: for word k, the values j whose bits [j*b, j*b+b) overlap [32k, 32k+32)
    rows = []
    for k in range(w):
        entries = []
        for j in range(g):
            lo = j * bits
            if lo < 32 * k + 32 and lo + bits > 32 * k:
                if lo >= 32 * k:
                    entries.append((j, 0, lo - 32 * k))  # (value, right shift, left shift)
                else:
                    entries.append((j, 32 * k - lo, 0))
        rows.append(entries)
    width = max(len(r) for r in rows)
    idx = np.full((w, width), g, dtype=np.int32)  # index g = an appended zero value
    rs = np.zeros((w, width), dtype=np.uint32)
    ls = np.zeros((w, width), dtype=np.uint32)
    for k, entries in enumerate(rows):
        for s, (j, r, l) in enumerate(entries):
            idx[k, s], rs[k, s], ls[k, s] = j, r, l
    # unpack: value j starts in word j*b // 32 at offset o; if it straddles it continues in the next word
    j = np.arange(g)
    start = j * bits
    wlo = (start // 32).astype(np.int32)
    off = (start % 32).astype(np.uint32)
    straddle = (off.astype(np.int64) + bits) > 32
    whi = np.where(straddle, wlo + 1, wlo).astype(np.int32)
    hshift = np.where(straddle, 32 - off.astype(np.int64), 0).astype(np.uint32)
    return {
        "g": g, "w": w, "width": width,
        "idx": mx.array(idx.reshape(-1)), "rs": mx.array(rs), "ls": mx.array(ls),
        "wlo": mx.array(wlo), "whi": mx.array(whi), "off": mx.array(off),
        "hshift": mx.array(hshift), "straddle": mx.array(straddle.astype(np.uint32)),
        "mask": mx.array(np.uint32((1 << bits) - 1)),
    }


def _to_mx(a, name):
    if isinstance(a, mx.array):
        return a, False
    if isinstance(a, np.ndarray):
        return mx.array(a), True
    raise TypeError(f"{name} must be an mx.array or numpy.ndarray, got {type(a).__name__}")


def _check_int_dtype(a, name):
    if a.dtype not in (mx.uint8, mx.uint16, mx.uint32, mx.int8, mx.int16, mx.int32, mx.int64, mx.uint64):
        raise TypeError(f"{name} must have an integer dtype (uint8/uint32 codes), got {a.dtype}")


def _check_range(codes: mx.array, bits: int, name: str) -> None:
    """ValueError naming ``name`` when a code is outside [0, 2^bits) (one host sync)."""
    if codes.size == 0:
        return
    lo, hi = (int(v) for v in (mx.min(codes), mx.max(codes)))
    if lo < 0 or hi >= 1 << bits:
        raise ValueError(f"{name} must be in [0, {1 << bits}) for bits={bits}, got values in [{lo}, {hi}]")


def pack(codes, bits: int, check: bool = True):
    """``(..., n)`` integer codes in [0, 2^bits) -> ``(..., ceil(n*bits/32))`` uint32.

    Out-of-range codes raise ValueError; ``check=False`` skips that test (one host sync) for codes that
    are in range by construction (codebook indices) and then masks them to ``bits`` bits.
    Returns numpy if given numpy, else mx.
    """
    bits = _check_bits(bits)
    codes, was_np = _to_mx(codes, "codes")
    _check_int_dtype(codes, "codes")
    if codes.ndim == 0:
        raise ValueError("codes must have at least one axis (..., n)")
    if check:
        _check_range(codes, bits, "codes")
    t = _tables(bits)
    g, w = t["g"], t["w"]
    lead, n = codes.shape[:-1], codes.shape[-1]
    n_words = (n * bits + 31) // 32
    n_groups = -(-n // g)
    rows = math.prod(lead)
    if n == 0 or rows == 0:
        out = mx.zeros((*lead, n_words), dtype=mx.uint32)
        return np.array(out) if was_np else out
    v = codes.astype(mx.uint32) & t["mask"]
    # pad to whole groups plus one zero column (the target of unused table slots)
    pad = n_groups * g - n
    v = v.reshape(rows, n)
    v = mx.pad(v, [(0, 0), (0, pad)]).reshape(-1, n_groups, g)
    v = mx.concatenate([v, mx.zeros(v.shape[:-1] + (1,), dtype=mx.uint32)], axis=-1)
    gathered = mx.take(v, t["idx"], axis=-1).reshape(v.shape[0], n_groups, w, t["width"])
    words = mx.sum((gathered >> t["rs"]) << t["ls"], axis=-1).astype(mx.uint32)  # (rows, G, w)
    out = words.reshape(v.shape[0], n_groups * w)[:, :n_words].reshape(*lead, n_words)
    return np.array(out) if was_np else out


def unpack(packed, bits: int, n: int):
    """Inverse of :func:`pack`: ``(..., words)`` uint32 -> ``(..., n)`` uint8 codes.

    Returns numpy if given numpy, else mx.
    """
    bits = _check_bits(bits)
    packed, was_np = _to_mx(packed, "packed")
    if packed.dtype != mx.uint32:
        raise TypeError(f"packed must be uint32, got {packed.dtype}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    n = int(n)
    n_words = (n * bits + 31) // 32
    if packed.ndim == 0 or packed.shape[-1] < n_words:
        raise ValueError(f"packed must have at least {n_words} words on its last axis for n={n}, "
                         f"bits={bits}; got shape {tuple(packed.shape)}")
    t = _tables(bits)
    g, w = t["g"], t["w"]
    lead = packed.shape[:-1]
    n_groups = -(-n // g)
    rows = math.prod(lead)
    if n == 0 or rows == 0:
        out = mx.zeros((*lead, n), dtype=mx.uint8)
        return np.array(out) if was_np else out
    p = packed[..., :n_words].reshape(rows, n_words)
    # one extra zero word so the straddle gather of the last value stays in range
    p = mx.pad(p, [(0, 0), (0, n_groups * w - n_words)]).reshape(-1, n_groups, w)
    p = mx.concatenate([p, mx.zeros(p.shape[:-1] + (1,), dtype=mx.uint32)], axis=-1)
    lo = mx.take(p, t["wlo"], axis=-1) >> t["off"]
    hi = (mx.take(p, t["whi"], axis=-1) << t["hshift"]) * t["straddle"]
    vals = ((lo | hi) & t["mask"]).astype(mx.uint8)  # (rows, G, g)
    out = vals.reshape(-1, n_groups * g)[:, :n].reshape(*lead, n)
    return np.array(out) if was_np else out


def packed_bytes(n: int, bits: int) -> int:
    """Number of bytes holding n codes of ``bits`` bits: ceil(n * bits / 8) (the seed's row length)."""
    bits = _check_bits(bits)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return (int(n) * bits + 7) // 8


def _as_codes(codes):
    # The seed passes numpy rows or plain lists; lists become numpy (and come back as numpy).
    if isinstance(codes, (list, tuple)):
        arr = np.asarray(codes)
        if arr.dtype == object or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"codes must be integers, got {codes!r:.80}")
        return arr.astype(np.int64)
    return codes


class BitPackBuffer:
    """The seed's packer: ``bits``-bit codes <-> rows of ``ceil(n * bits / 8)`` uint8, LSB-first.

    Value j of a row occupies stream bits [j*bits, (j+1)*bits); stream bit i is bit i % 8 of byte i // 8.
    Codes outside [0, 2^bits) raise ValueError. Accepts mx arrays, numpy arrays and lists of ints; returns
    mx for mx input, numpy otherwise. `words` / `pack` / `unpack` (module level) are the uint32 layout.
    """

    def __init__(self, bits: int):
        self.bits = _check_bits(bits)

    def pack(self, codes):
        """``(..., n)`` codes -> ``(..., packed_bytes(n, bits))`` uint8."""
        codes = _as_codes(codes)
        words = pack(codes, self.bits)  # range-checked
        n_bytes = packed_bytes(codes.shape[-1], self.bits)
        if isinstance(words, np.ndarray):
            return np.ascontiguousarray(words.astype("<u4").view(np.uint8)[..., :n_bytes])
        return mx.contiguous(words.view(mx.uint8)[..., :n_bytes])

    def unpack(self, packed, n: int):
        """``(..., bytes)`` uint8 (at least ``packed_bytes(n, bits)``) -> ``(..., n)`` uint8."""
        packed, was_np = _to_mx(packed, "packed")
        if packed.dtype != mx.uint8:
            raise TypeError(f"packed must be uint8 bytes (the layout BitPackBuffer.pack writes), got {packed.dtype}")
        n_bytes = packed_bytes(n, self.bits)
        if packed.ndim == 0 or packed.shape[-1] < n_bytes:
            raise ValueError(f"packed must have at least {n_bytes} bytes on its last axis for n={n}, "
                             f"bits={self.bits}; got shape {tuple(packed.shape)}")
        n_words = packed_words(n, self.bits)
        p = packed[..., :n_bytes]
        p = mx.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, 4 * n_words - n_bytes)])
        out = unpack(mx.contiguous(p).view(mx.uint32), self.bits, n)
        return np.array(out) if was_np else out

    def nbytes(self, n: int) -> int:
        """Bytes per row of n codes (`pack`'s last axis)."""
        return packed_bytes(n, self.bits)

    def words(self, n: int) -> int:
        """uint32 words per row of n codes in the module-level `pack` layout."""
        return packed_words(n, self.bits)

    def __repr__(self):
        return f"BitPackBuffer(bits={self.bits})"
