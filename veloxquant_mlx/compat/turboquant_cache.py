"""Standalone TurboQuant KV cache of one attention head: packed keys, int8 values, ring buffer.

Keys go through :class:`~veloxquant_mlx.quant.quantizers.TurboQuantProd` (``method="turboquant_prod"``:
``b-1``-bit MSE indices, 1-bit QJL signs of the residual, residual norm) or
:class:`~veloxquant_mlx.quant.quantizers.TurboQuantMSE` (``method="turboquant_mse"``: ``b``-bit indices)
at ``b = config.bit_width_inlier``, and the cache stores exactly what the quantizer's
:class:`~veloxquant_mlx.quant.encoded_vector.EncodedVector` holds (packed uint32 words, norms, ...), one
row per token. Values are stored per token as int8 codes with a float16 scale (absmax / 127).

Optionally (``enable_outlier_two_stream`` with ``n_outlier_channels > 0``) an
:class:`~veloxquant_mlx.compat.outlier.OutlierDetector` picks the key channels of largest RMS
over the first ``n_calib_tokens`` keys; from then on those channels are split off each key and
stored as int8 with a per-token float16 scale, and the key with those channels zeroed goes
through the quantizer. The score of a split key is ``q_in . k_in_hat + q_out . k_out_hat``.

This is a "standalone" method (:data:`~veloxquant_mlx.compat.methods.STANDALONE_METHODS`): it answers
attention itself (``attend``) and does not implement the mlx_lm cache protocol.

Semantics (what a user can rely on):

- Blocks: ``append_key``/``append_value`` take one row ``(d,)`` or a block ``(n, d)``; ``attend``
  takes ``(d,)`` or ``(m, d)`` and returns ``(d,)`` or ``(m, d)``: for each query row the exact
  softmax over every live token of ``score / sqrt(d)`` (no causal mask), scores from the
  quantizer's ``estimate_inner_product`` on the stored codes, values dequantized.
- Pairing: token ``t``'s value is the ``t``-th value appended. Keys may run ahead of values
  (append keys, then their values), never behind: ``append_value`` of more rows than keys are
  waiting raises ValueError, and so does ``attend`` while any key still waits for its value.
- Capacity: ``config.capacity=None`` keeps every token; otherwise the cache is a ring buffer of
  ``capacity`` tokens that evicts the oldest first (a block longer than ``capacity`` keeps its last
  ``capacity`` rows). Storage grows in steps of ``CACHE_GROWTH_STEP`` rows as tokens arrive and
  never exceeds ``capacity`` rows; nothing is preallocated.
- Order: token ``t`` lives in physical row ``t % capacity``; softmax does not depend on order, so
  ``attend`` uses the physical rows as they are. ``keys()`` / ``values()`` return the dequantized
  live history oldest-first.
- Outlier calibration: the detector sees every key block. Keys of a block appended when the
  detector has become calibrated (including the block that completes the calibration) are split;
  keys appended in earlier blocks stay unsplit: their quantized code carries the full vector and
  their outlier stream is empty (zero codes and scale), and ``attend`` scores them with the full
  query. So a first block of ``>= n_calib_tokens`` rows calibrates and splits from its first row.
- Output dtype: the dtype of the first values appended (kept as a name, so ``copy.deepcopy``
  works); the math runs in float32. An empty cache attends to zeros in the query's dtype.
- ``reset()`` drops every token and restarts the outlier calibration; the quantizer (a
  deterministic function of ``d, b, seed``) is kept and shared by ``copy.deepcopy`` copies.
"""
from __future__ import annotations

import copy
import math
from typing import Any

import mlx.core as mx

from veloxquant_mlx.compat._ring import dtype_name as _dtype_name
from veloxquant_mlx.compat._ring import int8_absmax as _int8_absmax
from veloxquant_mlx.compat._ring import read_slots, slot_ranges, write_slots
from veloxquant_mlx.compat.outlier import OutlierDetector
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.compat.abstractions import KVCache, as_float_rows
from veloxquant_mlx.compat.constants import CACHE_GROWTH_STEP
from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.quantizers import QUANTIZERS
from veloxquant_mlx.quant.quantizer_common import to_output_dtype

# The methods this standalone cache offers (documented as ``veloxquant_mlx.cache.base.STANDALONE_METHODS``: that path
# is `veloxquant_mlx.compat.methods`, which reads it from here).
STANDALONE_METHODS = frozenset({"turboquant_mse", "turboquant_prod"})


class TurboQuantKVCache(KVCache):
    """TurboQuant-compressed standalone KV cache (see the module docstring for the semantics).

    Args:
        config: a :class:`~veloxquant_mlx.compat.config.KVCacheConfig` with ``method`` in
            ``STANDALONE_METHODS``, ``head_dim`` set; read also: ``bit_width_inlier``, ``jl_dim``
            (Prod sketch size, default ``TurboQuantProd.m_default``), ``seed``, ``rotation``,
            ``capacity``, ``enable_outlier_two_stream``, ``n_outlier_channels``,
            ``n_calib_tokens``. Values are always int8 (``v_bits`` must be None or 8) and outlier
            channels int8 (``outlier_bits`` must be 8).
    """

    def __init__(self, config: Any) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        if config.method not in STANDALONE_METHODS:
            raise ValueError(
                f"TurboQuantKVCache supports method in STANDALONE_METHODS={sorted(STANDALONE_METHODS)}, "
                f"got method={config.method!r}"
            )
        if config.head_dim is None:
            raise ValueError("TurboQuantKVCache needs config.head_dim (the key/value length d), got None")
        if config.v_bits not in (None, 8):
            raise ValueError(f"TurboQuantKVCache stores values as int8: v_bits must be None or 8, got {config.v_bits}")
        two_stream = bool(config.enable_outlier_two_stream) and config.n_outlier_channels > 0
        if two_stream and config.outlier_bits != 8:
            raise ValueError(
                f"TurboQuantKVCache stores outlier channels as int8: outlier_bits must be 8, got {config.outlier_bits}"
            )

        self.config = config
        self.d = int(config.head_dim)
        self.b = int(config.bit_width_inlier)
        self.capacity: int | None = config.capacity
        cls = QUANTIZERS[config.method]
        if config.method == "turboquant_prod":
            m = config.jl_dim if config.jl_dim is not None else cls.m_default(self.d, self.b)
            self.quantizer = cls(self.d, self.b, m=m, seed=config.seed, rotation=config.rotation)
        else:
            self.quantizer = cls(self.d, self.b, seed=config.seed, rotation=config.rotation)
        self._detector = (
            OutlierDetector(config.n_outlier_channels, config.n_calib_tokens) if two_stream else None
        )
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Drop every token, restart the outlier calibration; keep the quantizer."""
        self._n_keys = 0  # keys appended since reset (evicted ones included): next key is token _n_keys
        self._n_values = 0  # values appended since reset
        self._rows = 0  # rows allocated in every buffer
        # Key rows: the EncodedVector fields by name, plus "outlier_codes"/"outlier_scales".
        self._k: dict[str, mx.array] = {}
        # Value rows: "codes" (rows, d) int8, "scales" (rows,) float16.
        self._v: dict[str, mx.array] = {}
        self._ev_type: str | None = None
        self._ev_dtype_name = "float32"
        self._storage_dtype_name: str | None = None
        # Outlier split: first token stored split, and the (n_out, d) one-hot embedding of the
        # outlier channels (q @ E.T picks them, codes @ E puts them back).
        self._split_from: int | None = None
        self._outlier_embed: mx.array | None = None
        self._inlier_mask: mx.array | None = None  # (d,) 1 on inlier channels, 0 on outliers
        if self._detector is not None:
            self._detector.reset()

    def __deepcopy__(self, memo: dict) -> "TurboQuantKVCache":
        # The quantizer is never mutated after construction (rotation, codebook, QJL matrix are
        # fixed by d, b, seed), so copies share it; everything else is copied.
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, value if name == "quantizer" else copy.deepcopy(value, memo))
        return new

    @property
    def storage_dtype(self) -> mx.Dtype | None:
        """Dtype of the values first appended (``attend``'s output dtype); None before that."""
        return None if self._storage_dtype_name is None else getattr(mx, self._storage_dtype_name)

    @property
    def tokens_seen(self) -> int:
        """Keys appended since the last reset, evicted ones included."""
        return self._n_keys

    @property
    def outlier_channels(self) -> list[int] | None:
        """The split-off key channels once calibrated, else None."""
        if self._detector is None or not self._detector.is_calibrated:
            return None
        return self._detector.get_outlier_channels().tolist()

    def _live(self, n_total: int) -> int:
        return n_total if self.capacity is None else min(n_total, self.capacity)

    def __len__(self) -> int:
        """Live keys (at most ``capacity``)."""
        return self._live(self._n_keys)

    def _first_live(self) -> int:
        return self._n_keys - len(self)

    # ------------------------------------------------------------------ ring-buffer plumbing (compat/_ring.py)

    def _slot_ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Physical row ranges of logical tokens ``[lo, hi)``, in order (one or two)."""
        return slot_ranges(self.capacity, lo, hi)

    def _write(self, buf: mx.array, lo: int, hi: int, rows: mx.array) -> mx.array:
        """Write ``rows`` (``hi - lo`` rows) at the slots of tokens ``[lo, hi)``; returns the buffer."""
        return write_slots(buf, self.capacity, lo, hi, rows)

    def _read(self, buf: mx.array, lo: int, hi: int) -> mx.array:
        """Rows of tokens ``[lo, hi)`` in logical order."""
        return read_slots(buf, self.capacity, lo, hi)

    def _grow(self, needed: int, key_rows: dict[str, mx.array]) -> None:
        """Make every buffer at least ``needed`` rows, in steps of CACHE_GROWTH_STEP, at most capacity.

        ``key_rows`` (name -> new rows) gives the trailing shape and dtype of each key buffer the
        first time.
        """
        if needed <= self._rows:
            return
        new_rows = -(-needed // CACHE_GROWTH_STEP) * CACHE_GROWTH_STEP
        if self.capacity is not None:
            new_rows = min(new_rows, self.capacity)
        templates = {("k", n): (a.shape[1:], a.dtype) for n, a in key_rows.items()}
        templates[("v", "codes")] = ((self.d,), mx.int8)
        templates[("v", "scales")] = ((), mx.float16)
        for (side, name), (tail, dtype) in templates.items():
            store = self._k if side == "k" else self._v
            pad = mx.zeros((new_rows - self._rows, *tail), dtype=dtype)
            old = store.get(name)
            store[name] = pad if old is None else mx.concatenate([old, pad], axis=0)
        self._rows = new_rows

    # ------------------------------------------------------------------ appends

    def _check_finite(self, x: mx.array, name: str) -> None:
        # One host sync per call: a NaN/inf stored in a code or scale would silently turn every
        # later attend into NaN, so it is refused at the door, naming the argument.
        if not mx.all(mx.isfinite(x)).item():
            raise ValueError(f"{name} contains NaN or inf")

    def append_key(self, k: Any) -> None:
        """Encode and store one key ``(d,)`` or a block of keys ``(n, d)`` (float dtype)."""
        k = as_float_rows(k, "k", self.d)
        if k.ndim == 1:
            k = k[None]
        n = k.shape[0]
        if n == 0:
            return
        self._check_finite(k, "k")
        if self._detector is not None and self._split_from is None:
            self._detector.observe(k)
            if self._detector.is_calibrated:
                self._start_split()

        hi = self._n_keys + n
        keep = n if self.capacity is None else min(n, self.capacity)  # older rows evict themselves
        lo = hi - keep
        x = k[n - keep :].astype(mx.float32)  # (keep, d)
        new: dict[str, mx.array] = {}
        if self._detector is not None:
            if self._split_from is not None:
                new["outlier_codes"], new["outlier_scales"] = _int8_absmax(x @ self._outlier_embed.T)
                x = x * self._inlier_mask
                if not mx.all(mx.isfinite(new["outlier_scales"])).item():
                    raise ValueError("k has outlier channels too large for an int8 code with a float16 scale (|k| > 8.3e6)")
            else:
                n_out = self._detector.n_outliers
                new["outlier_codes"] = mx.zeros((keep, n_out), dtype=mx.int8)
                new["outlier_scales"] = mx.zeros((keep,), dtype=mx.float16)
        ev = self.quantizer.encode(x)  # batch shape (keep,)
        new.update(ev.arrays())
        self._ev_type, self._ev_dtype_name = ev.quantizer_type, ev.dtype_name

        self._grow(self._live(hi), new)
        for name, rows in new.items():
            self._k[name] = self._write(self._k[name], lo, hi, rows)
        self._n_keys = hi
        # Evaluate now: a standalone cache is fed call by call, and a lazy chain of thousands of
        # slice updates would hold every intermediate; evaluated buffers are updated in place.
        mx.eval(*self._k.values(), *self._v.values())

    def _start_split(self) -> None:
        channels = self._detector.get_outlier_channels().tolist()
        embed = mx.zeros((len(channels), self.d), dtype=mx.float32)
        embed[mx.arange(len(channels)), mx.array(channels)] = 1.0
        self._outlier_embed = embed  # (n_out, d)
        self._inlier_mask = 1.0 - mx.sum(embed, axis=0)  # (d,)
        self._split_from = self._n_keys

    def append_value(self, v: Any) -> None:
        """Store the value(s) ``(d,)`` or ``(n, d)`` of the next keys that have none yet."""
        v = as_float_rows(v, "v", self.d)
        if v.ndim == 1:
            v = v[None]
        n = v.shape[0]
        if n == 0:
            return
        self._check_finite(v, "v")
        waiting = self._n_keys - self._n_values
        if n > waiting:
            raise ValueError(
                f"v has {n} rows but only {waiting} appended keys wait for a value: "
                "append the keys first (append_key), then their values"
            )
        hi = self._n_values + n
        keep = n if self.capacity is None else min(n, self.capacity)
        lo = hi - keep
        codes, scales = _int8_absmax(v[n - keep :].astype(mx.float32))
        if not mx.all(mx.isfinite(scales)).item():
            raise ValueError("v is too large for int8 codes with a float16 scale (|v| > 8.3e6)")
        if self._storage_dtype_name is None:
            self._storage_dtype_name = _dtype_name(v.dtype)
        self._v["codes"] = self._write(self._v["codes"], lo, hi, codes)
        self._v["scales"] = self._write(self._v["scales"], lo, hi, scales)
        self._n_values = hi
        mx.eval(self._v["codes"], self._v["scales"])

    # ------------------------------------------------------------------ reading

    def _encoded(self, rows: dict[str, mx.array]) -> EncodedVector:
        fields = {n: a for n, a in rows.items() if not n.startswith("outlier_")}
        return EncodedVector(self._ev_type, self.d, dtype_name=self._ev_dtype_name, **fields)

    def _unsplit_rows(self, n: int) -> mx.array | None:
        """``(n,)`` bool over physical rows ``[0, n)``: True where the key was stored unsplit.

        None when every live key is split (the usual case once calibrated).
        """
        if self._split_from is None or self._split_from <= self._first_live():
            return None
        p = mx.arange(n)
        if self.capacity is None or self._n_keys <= self.capacity:
            token = p
        else:  # the newest token t <= n_keys - 1 with t % capacity == p
            token = self._n_keys - 1 - ((self._n_keys - 1 - p) % self.capacity)
        return token < self._split_from

    def _check_query(self, q: Any) -> tuple[mx.array, bool, mx.Dtype]:
        """Validate ``q`` and the key/value pairing; returns ``(q as (m, d) float32, was_1d, q's dtype)``."""
        q = as_float_rows(q, "q", self.d)
        self._check_finite(q, "q")
        if self._n_keys != self._n_values:
            raise ValueError(
                f"attending needs a value for every key: {self._n_keys} keys but {self._n_values} values "
                "appended; append_value the rest first"
            )
        single = q.ndim == 1
        return (q[None] if single else q).astype(mx.float32), single, q.dtype

    def _scores(self, qf: mx.array, n: int) -> mx.array:
        """Raw scores ``q . k_hat`` of ``qf (m, d)`` float32 against physical rows ``[0, n)``: ``(m, n)``."""
        # Physical rows [0, n) are exactly the live tokens (in ring order, which softmax ignores).
        rows = {name: buf[:n] for name, buf in self._k.items()}
        ev = self._encoded(rows)
        if self._split_from is None:
            return self.quantizer.estimate_inner_product(qf, ev)  # (m, n)
        # Split keys are exactly zero on the outlier channels, so the quantized part is scored
        # with those channels of q zeroed, and the int8 outlier stream adds q_out . k_out_hat.
        scores = self.quantizer.estimate_inner_product(qf * self._inlier_mask, ev)
        q_out = qf @ self._outlier_embed.T  # (m, n_out)
        codes = rows["outlier_codes"].astype(mx.float32)  # (n, n_out)
        scores = scores + (q_out @ codes.T) * rows["outlier_scales"].astype(mx.float32)
        unsplit = self._unsplit_rows(n)
        if unsplit is not None:  # their code carries the whole key: add the outlier part of q
            extra = self.quantizer.estimate_inner_product(qf * (1.0 - self._inlier_mask), ev)
            scores = scores + mx.where(unsplit, extra, 0.0)
        return scores

    def scores(self, q: Any) -> mx.array:
        """Estimated ``q . k`` (before the 1/sqrt(d) scale) against the live keys, oldest first.

        ``q`` ``(d,)`` or ``(m, d)`` -> ``(n,)`` or ``(m, n)`` float32 (for tests and inspection).
        """
        qf, single, _ = self._check_query(q)
        n = len(self)
        s = self._scores(qf, n)
        lo = self._first_live()
        # Physical row of logical token t is t % capacity: reorder the (at most two) runs.
        parts = [s[:, a:b] for a, b in self._slot_ranges(lo, lo + n)] if n else [s]
        s = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
        return s[0] if single else s

    def attend(self, q: Any) -> mx.array:
        """Softmax attention of ``q`` (``(d,)`` or ``(m, d)``) over every live token.

        Returns ``(d,)`` or ``(m, d)`` in the values' dtype. Raises ValueError while a key waits
        for its value.
        """
        qf, single, q_dtype = self._check_query(q)
        n = len(self)
        if n == 0:  # softmax over no token: documented as zeros
            return mx.zeros(qf.shape[1:] if single else qf.shape, dtype=q_dtype)
        probs = mx.softmax(self._scores(qf, n) * (1.0 / math.sqrt(self.d)), axis=-1)  # (m, n)
        # Fold the per-token value scale into the weights: (m, n) @ (n, d) on the raw int8 codes.
        weights = probs * self._v["scales"][:n].astype(mx.float32)
        out = weights @ self._v["codes"][:n].astype(mx.float32)  # (m, d)
        # A float16 value near its max comes back as 127 * its rounded-up scale (65504 -> 65532), past float16's
        # range: clipped to the values' dtype's finite range rather than cast to inf.
        out = to_output_dtype(out, self._storage_dtype_name)
        return out[0] if single else out

    def keys(self) -> mx.array:
        """Dequantized live keys ``(len, d)`` float32, oldest first: the quantizer's ``decode`` (for
        TurboQuantProd its unbiased reconstruction), with the int8 outlier channels put back in
        split rows. ``scores(q)`` equals ``q @ keys().T`` up to float rounding."""
        lo, hi = self._first_live(), self._n_keys
        if hi == lo:
            return mx.zeros((0, self.d), dtype=mx.float32)
        rows = {name: self._read(buf, lo, hi) for name, buf in self._k.items()}
        k_hat = self.quantizer.decode(self._encoded(rows)).astype(mx.float32)  # (n, d)
        if self._split_from is not None:
            out = rows["outlier_codes"].astype(mx.float32) * rows["outlier_scales"].astype(mx.float32)[:, None]
            split_k = k_hat * self._inlier_mask + out @ self._outlier_embed
            is_split = (mx.arange(lo, hi) >= self._split_from)[:, None]
            k_hat = mx.where(is_split, split_k, k_hat)
        return k_hat

    def values(self) -> mx.array:
        """Dequantized live values ``(n, d)`` float32, oldest first (values of live keys only)."""
        lo, hi = self._first_live(), self._n_values
        if hi <= lo:
            return mx.zeros((0, self.d), dtype=mx.float32)
        codes = self._read(self._v["codes"], lo, hi).astype(mx.float32)
        return codes * self._read(self._v["scales"], lo, hi).astype(mx.float32)[:, None]

    # ------------------------------------------------------------------ accounting

    def memory_bytes(self) -> int:
        """Bytes stored for the live tokens: each buffer's bytes per row times its live rows.

        Per token: ``4 * ceil(d * b_mse / 32)`` (packed indices) + 2 (key norm, bfloat16) and for
        Prod ``4 * ceil(m / 32)`` (packed QJL signs) + 2 (residual norm); ``d + 2`` for the value
        (int8 codes, fp16 scale); with the outlier stream ``n_outlier_channels + 2``. When
        ``d * b_mse`` and ``m`` are multiples of 32 this is the seed's formula (``ceil(d*b_mse/8)
        + ceil(m/8) + 2 + d + 2 + n_out + 2``) plus the 2 bytes of the key norm, which the seed
        did not store; otherwise each row is padded to whole uint32 words. Allocated but unused
        rows (growth slack) are not counted; ``allocated_bytes`` counts them.
        """
        live_k = len(self)
        live_v = max(0, self._n_values - self._first_live())
        per_k = sum(a.nbytes // a.shape[0] for a in self._k.values()) if self._rows else 0
        per_v = sum(a.nbytes // a.shape[0] for a in self._v.values()) if self._rows else 0
        return live_k * per_k + live_v * per_v

    def allocated_bytes(self) -> int:
        """Bytes of every buffer as allocated (live rows plus growth slack)."""
        return sum(a.nbytes for a in (*self._k.values(), *self._v.values()))

    def stored_rows(self) -> int:
        """Rows allocated in each buffer (grows in steps, never beyond ``capacity``)."""
        return self._rows

    def __repr__(self) -> str:
        if self._detector is None:
            outliers = "off"
        elif self._split_from is None:
            outliers = f"calibrating {self._detector.n_observed}/{self._detector.n_calib}"
        else:
            outliers = str(self.outlier_channels)
        return (
            f"TurboQuantKVCache(method={self.config.method!r}, d={self.d}, b={self.b}, "
            f"tokens={len(self)}, capacity={self.capacity}, outliers={outliers}, "
            f"bytes={self.memory_bytes()})"
        )
