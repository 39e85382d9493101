"""`Rows`: the one storage engine behind every packed cache. A single sequence is a batch of one.

Each row (sequence) ``i`` keeps, in temporal order, ``[sink | codes | tail]``:

- sink ``(B, H, S, d)`` exact: row i's first ``sink_n[i]`` tokens, left-aligned (``S = options.sink``);
- codes (one `RowCodes` per codec, the codec's declared layout): row i's coded tokens in slots ``[0, coded[i])``,
  blocks counted from the row's own first coded token (a row codes the same token sets as it would alone). A
  sliding window evicts the oldest codes after its ``keep`` prefix: slots ``[pin, pin + gone[i])`` are a hole,
  never attended (``pin = keep - sink``), dropped for every row at once when all rows have evicted enough;
- tail ``(B, H, L, d)`` exact: row i's newest ``tail_n[i]`` tokens, right-aligned (new tokens arrive at the end
  for every row). The tail holds the last ``recent`` tokens plus up to ``trim_headroom`` older ones (read through
  an encode/decode round trip, exactly as coded tokens read) and up to ``code_step - 1`` more that wait for their
  turn: a block codec codes whole blocks, a per-token codec without an exact window ``options.code_batch`` tokens
  at a time (no headroom then: nothing is kept exact that a trim would need). Whole steps are counted from the row's first
  coded token, so what is stored depends on the token count only, never on how the tokens were chunked.

Free slots (after a row's codes, before its tail) are padding: finite, never attended. Fitted codec parameters
are per (sequence, head): rows fit at the moment and on the tokens they would alone, and the codecs see the batch
folded into their head axis (``(1, B*H, ...)``). Caches (:mod:`veloxquant_mlx.cache.packed_cache`) are thin
faces over a `Rows`: a single sequence, a batch (mlx_lm's BatchGenerator), either with a sliding window.
"""
from __future__ import annotations

import copy
import threading
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import dynamic_roll

from veloxquant_mlx.attention.kernel import gather_rows
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart
from veloxquant_mlx.cache._token_store import CodedTail
from veloxquant_mlx.codecs import codec_layout

CODE_STEP = 256  # code slots added at a time for per-token codecs (block codecs grow one block at a time)
TAIL_STEP = 16  # exact tail slots added at a time
COUNTS = ("lengths", "sink_n", "gone", "coded", "tail_n")  # per-row token counts


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def fold(a: mx.array) -> mx.array:
    """``(B, H, ...)`` -> ``(1, B*H, ...)``: codecs then treat every (sequence, head) as a head of their own."""
    return a if a.shape[0] == 1 else a.reshape((1, a.shape[0] * a.shape[1]) + tuple(a.shape[2:]))


def column(values: Sequence[int]) -> mx.array:
    return mx.array(list(values), dtype=mx.int32).reshape(-1, 1, 1, 1)


class TailCoder:
    """How a block layout stores the tokens waiting for their key block (`CodedTail`'s coder): keys as the key
    codec's provisional per-token codes (``tail_codec()``), values as the value codec's own codes (they move into
    the value store unchanged when their block is coded). Raw fields ``k_<field>`` / ``v_<field>``.

    Centred block keys (``center_keys``) centre the provisional codes on the same fitted mean: the coder is then
    bound to the rows' folded key codec (`bound`, ``(B*H, d)`` means: the batch is folded into the heads to code),
    and each row fits on arrival (`Rows.append`), before any of its tokens is stored."""

    def __init__(self, k_codec, v_codec, key_codec=None):
        self.k, self.v = k_codec, v_codec
        self.key_codec = key_codec  # the block key codec whose fitted mean centres the provisional keys (or None)

    @property
    def centred(self) -> bool:
        return self.k.center

    def bound(self, key_codec) -> "TailCoder":
        """This coder with the provisional keys centred on ``key_codec``'s fitted mean (folded over rows)."""
        return TailCoder(key_codec.tail_codec(), self.v, key_codec)

    @staticmethod
    def for_codecs(options, base) -> Optional["TailCoder"]:
        """The coder of a layout that declares one (a key codec with ``tail_codec``, a value codec with
        ``codes_tail``), when nothing but the keys' mean is fitted and no exact window is asked for; else None
        (an exact tail)."""
        k, v = base
        if not (hasattr(k, "tail_codec") and getattr(v, "codes_tail", False)) or options.recent:
            return None
        if set(k.blank_fitted(1)) - {"mean"} or v.blank_fitted(1):
            return None
        return TailCoder(k.tail_codec(), v)

    def fields(self, dims) -> Dict[str, tuple]:
        return {**{"k_" + f: spec for f, spec in self.k.token_fields().items()},
                **{"v_" + f: spec for f, spec in self.v.token_fields().items()}}

    def split(self, raw: Dict[str, mx.array]):
        """Raw fields -> (key codes, value codes)."""
        return ({f[2:]: a for f, a in raw.items() if f.startswith("k_")},
                {f[2:]: a for f, a in raw.items() if f.startswith("v_")})

    def _folds(self, x: mx.array) -> bool:
        """Whether ``(B, H, ...)`` arrays go through the key codec folded ``(1, B*H, ...)`` (per-row means)."""
        mean = self.k.mean if self.centred else None
        return mean is not None and x.shape[0] > 1 and mean.shape[0] == x.shape[0] * x.shape[1]

    def encode(self, chunk: Dict[str, mx.array]) -> Dict[str, mx.array]:
        k = chunk["k"]
        if self._folds(k):
            B, H = k.shape[:2]
            k_codes = {f: a.reshape((B, H) + a.shape[2:])
                       for f, a in self.k.encode(k.reshape((1, B * H) + k.shape[2:])).items()}
        else:
            k_codes = self.k.encode(k)
        return {**{"k_" + f: a for f, a in k_codes.items()},
                **{"v_" + f: a for f, a in self.v.encode(chunk["v"]).items()}}

    def decode(self, raw: Dict[str, mx.array], dtypes) -> Dict[str, mx.array]:
        k, v = self.split(raw)
        first = next(iter(k.values()))
        if self._folds(first):
            B, H = first.shape[:2]
            keys = self.k.decode({f: a.reshape((1, B * H) + a.shape[2:]) for f, a in k.items()}, dtypes["k"])
            keys = keys.reshape((B, H) + keys.shape[2:])
        else:
            keys = self.k.decode(k, dtypes["k"])
        return {"k": keys, "v": self.v.decode(v, dtypes["v"])}


# -- what a codec declares, read once per configuration ------------------------------------------------------
_LAYOUTS: Dict[tuple, tuple] = {}


def _layouts(options, dims, heads):
    """(base codecs, code layouts, blank fitted arrays) of one configuration: the same for every layer and merge."""
    # per thread: MLX arrays belong to the stream of the thread that made them (mlx_lm.server generates in its own)
    key = (options, dims, heads, threading.get_ident())
    hit = _LAYOUTS.get(key)
    if hit is None:
        base = codec_layout(options.codec).make(options, *dims)
        for c in base:
            for name, a in c.blank_fitted(heads).items():
                if a.shape[0] != heads:
                    raise ValueError(f"codec={options.codec!r}: fitted array {name!r} of shape {tuple(a.shape)} is "
                                     f"not per head ({heads} heads), so sequences cannot be batched")
        layouts = tuple({f: (c.axis, c.units, tuple(c.block_shape), c.dtype)
                         for f, c in codec.code_layout(heads).items()} for codec in base)
        hit = _LAYOUTS[key] = (base, layouts, tuple(c.blank_fitted(heads) for c in base))
    return hit


class RowCodes:
    """One codec's codes of B rows: arrays ``(B, H, ...)`` holding ``capacity`` token slots per row."""

    def __init__(self, codec, layout: dict, grow: int):
        self.codec, self.layout, self.grow, self.block = codec, layout, grow, codec.token_block
        self.arrays: Dict[str, mx.array] = {}
        self.capacity = 0

    @property
    def arrays(self) -> Dict[str, mx.array]:
        return self._arrays

    @arrays.setter
    def arrays(self, value: Dict[str, mx.array]) -> None:
        self._arrays = value
        self._views = {}  # `folded` / `row_view` views (and `Rows._coded_part` s) of the arrays just replaced

    def zeros(self, rows: int, tokens: int) -> Dict[str, mx.array]:
        out = {}
        for f, (axis, units, shape, dtype) in self.layout.items():
            shape = list(shape)
            shape[0], shape[axis] = rows, units * tokens // self.block
            out[f] = mx.zeros(shape, dtype)
        return out

    def padded(self, rows: int, capacity: int) -> Dict[str, mx.array]:
        """The arrays grown to ``capacity`` slots (zeros after), ``self`` unchanged."""
        if capacity <= self.capacity:
            return self.arrays
        extra = self.zeros(rows, capacity - self.capacity)
        return self.codec.concat([self.arrays, extra]) if self.arrays else extra

    def reserve(self, rows: int, tokens: int) -> None:
        """At least ``tokens`` slots per row (zeros: finite, never attended)."""
        if tokens > self.capacity:
            new = _round_up(tokens, self.grow)
            self.arrays, self.capacity = self.padded(rows, new), new

    def _index(self, f: str, row: int, start: int, stop: int):
        axis, units, _, _ = self.layout[f]
        lo, hi = start // self.block * units, stop // self.block * units
        return (slice(row, row + 1),) + (slice(None),) * (axis - 1) + (slice(lo, hi),)

    def write_row(self, row: int, start: int, codes: Dict[str, mx.array], rows: int) -> None:
        """Row ``row``'s slots from ``start`` get ``codes`` (one row, whole blocks)."""
        n = self.codec.n_tokens(codes)
        if rows == 1 and start == self.capacity and self.block > 1:
            # one sequence coding its next block: append, the arrays stay exactly full and contiguous (what the
            # scoring matmul wants), one copy of the codes per block
            self.arrays = self.codec.concat([self.arrays, codes]) if self.arrays else dict(codes)
            self.capacity += n
            return
        self.reserve(rows, start + n)
        self._views = {}
        for f, a in codes.items():
            self.arrays[f][self._index(f, row, start, start + n)] = a

    def folded(self, n: int) -> Dict[str, mx.array]:
        """The first ``n`` slots of every row, folded to ``(1, B*H, ...)`` (views kept until the arrays change)."""
        hit = self._views.get(n)
        if hit is None:
            self._bound_views()
            hit = {f: fold(a) for f, a in self.arrays.items()}
            hit = self._views[n] = hit if n == self.capacity else self.codec.slice_tokens(hit, 0, n)
        return hit

    def _bound_views(self) -> None:
        if len(self._views) >= 8:  # (trims move the ranges without replacing the arrays)
            self._views.clear()

    def row_view(self, i: int, start: int, stop: int) -> Dict[str, mx.array]:
        """Row ``i``'s slots ``[start, stop)`` ``(1, H, ...)`` (views, the same objects until the arrays change)."""
        key = (i, start, stop)
        hit = self._views.get(key)
        if hit is None:
            self._bound_views()
            arrays = self.arrays if self.arrays[next(iter(self.arrays))].shape[0] == 1 else \
                {f: a[i:i + 1] for f, a in self.arrays.items()}
            hit = self._views[key] = arrays if (start, stop) == (0, self.capacity) else \
                self.codec.slice_tokens(arrays, start, stop)
        return hit

    def row_live(self, i: int, pin: int, gone: int, coded: int) -> Dict[str, mx.array]:
        """Row ``i``'s live codes without the evicted hole, in their own memory (what a saved state holds)."""
        if not coded or not self.arrays:
            return {}
        pieces = [self.row_view(i, 0, min(pin, coded))] if gone and pin else []
        pieces.append(self.row_view(i, pin + gone if gone else 0, coded))
        return {f: mx.contiguous(a) for f, a in self.codec.concat([p for p in pieces if p]).items()}

    def drop(self, lo: int, hi: int) -> None:
        """Forget slots ``[lo, hi)`` of every row (a sliding window's evicted tokens; one copy)."""
        pieces = [self.codec.slice_tokens(self.arrays, 0, lo)] if lo else []
        pieces.append(self.codec.slice_tokens(self.arrays, hi, self.capacity))
        self.arrays = {f: mx.contiguous(a) for f, a in self.codec.concat(pieces).items()}
        self.capacity -= hi - lo

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` slots (rounded up to a growth step): frees trimmed or taken-away slots."""
        cap = _round_up(n, self.grow)
        if cap < self.capacity:
            kept = self.codec.slice_tokens(self.arrays, 0, cap) if cap else {}
            self.arrays, self.capacity = {f: mx.contiguous(a) for f, a in kept.items()}, cap

    def copy(self) -> "RowCodes":
        new = copy.copy(self)
        new.arrays = {f: copy.copy(a) for f, a in self.arrays.items()}  # new objects, shared data (as TokenStore.copy)
        return new

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


class Rows:
    """B sequences' stored tokens (see the module docstring); ``window``: ``(max_size, keep)`` or None."""

    def __init__(self, options, batch_size: int, window: Optional[tuple] = None):
        self.options, self.B, self.window = options, batch_size, window
        self.pin = window[1] - options.sink if window else 0  # code slots a window keeps forever
        for name in COUNTS:
            setattr(self, name, [0] * batch_size)
        self.fitted = [False] * batch_size
        self.dims: Optional[tuple] = None  # (key head_dim, value head_dim), fixed by the first update
        self.heads = 0
        self.sink: Optional[Dict[str, mx.array]] = None  # {"k", "v"}: (B, H, S, d)
        self._sink_views = None  # (sink k, sink v, S, folded part): `_sink_part`
        self.k_codes = self.v_codes = None  # RowCodes
        self.tail = CodedTail(TAIL_STEP)  # exact, or coded once the codecs are known (`setup`)
        self.base = None  # (key codec, value codec), unfitted
        self.k_codec = self.v_codec = None  # fitted parameters of every row, folded ``(B*H, ...)``

    @property
    def k_codec(self):
        return self._k_codec

    @k_codec.setter
    def k_codec(self, codec) -> None:
        # a tail coded on the keys' fitted mean follows every change of it (fits, merges, restores)
        self._k_codec = codec
        coder = self.tail.coder
        if codec is not None and coder is not None and coder.centred and coder.key_codec is not codec:
            self.tail.coder = coder.bound(codec)

    @property
    def fits_on_arrival(self) -> bool:
        """Whether rows fit before their first token is stored (a tail coded on the fitted key mean)."""
        coder = self.tail.coder
        return coder is not None and coder.centred

    @property
    def block(self) -> int:
        return self.base[0].token_block if self.base is not None else 1

    @property
    def code_step(self) -> int:
        """Tokens coded together (see the module docstring): a block, ``options.code_batch``, or 1 with an exact
        window (its tokens are coded as they leave it)."""
        return self.block if self.block > 1 else (1 if self.options.recent else self.options.code_batch)

    @property
    def exact_keep(self) -> int:
        """Newest tokens every row keeps in its tail besides those waiting for their step."""
        o = self.options
        return o.recent + o.trim_headroom if self.block > 1 or o.recent else 0

    def setup(self, k_dim: int, v_dim: int, heads: int) -> None:
        """Make the codecs and their stores once the head dims are known (first update, or a restore)."""
        if self.options.head_dim is not None and self.options.head_dim != k_dim:
            raise ValueError(f"keys have head_dim {k_dim}, but the cache was set up for "
                             f"head_dim={self.options.head_dim}")
        self.options = self.options.for_dims(k_dim, v_dim)  # (as the cache's first update decided: the same)
        self.base, layouts, _ = _layouts(self.options, (k_dim, v_dim), heads)
        self.dims, self.heads = (k_dim, v_dim), heads
        # With block keys, values arrive a whole block at a time: growing by one block keeps their store exactly
        # full, so attention reads whole contiguous arrays (no slice, no copy inside the quantized matmul).
        grow = self.block if self.block > 1 else CODE_STEP
        self.k_codes, self.v_codes = (RowCodes(c, lay, grow) for c, lay in zip(self.base, layouts))
        if not self.tail.length:  # (a tail of the layout's own kind; restores load it after this)
            self.tail.coder = TailCoder.for_codecs(self.options, self.base) if not self.window else None
        self.k_codec, self.v_codec = (self.unfitted(w, self.B) for w in (0, 1))

    def unfitted(self, which: int, rows: int):
        """``rows`` rows' codec before their fits: blank parameters (one sequence: none, as a fresh codec)."""
        base = self.base[which]
        if rows == 1:
            return base
        blank = _layouts(self.options, self.dims, self.heads)[2][which]
        return base.with_fitted({n: mx.concatenate([a] * rows, axis=0) for n, a in blank.items()}) if blank else base

    def fitted_rows(self, which: int) -> Dict[str, mx.array]:
        """Every row's fitted parameters ``(B*H, ...)`` (blank ones for rows not fitted yet)."""
        arrays = (self.k_codec, self.v_codec)[which].fitted_arrays()
        blank = _layouts(self.options, self.dims, self.heads)[2][which]
        return arrays if arrays or not blank else {n: mx.concatenate([a] * self.B, axis=0) for n, a in blank.items()}

    def row_codec(self, which: int, i: int):
        """Row ``i``'s own codec (its fitted parameters), as the sequence alone holds it."""
        folded = (self.k_codec, self.v_codec)[which]
        if self.B == 1:
            return folded
        if not self.fitted[i]:
            return self.base[which]
        H = self.heads
        return self.base[which].with_fitted({n: a[i * H:(i + 1) * H] for n, a in folded.fitted_arrays().items()})

    def _tail_key_codec(self, i: int):
        """The codec of row ``i``'s provisional keys (its own fitted mean, when the tail is centred on it)."""
        return self.row_codec(0, i).tail_codec() if self.fits_on_arrival else self.tail.coder.k

    def _fit_row(self, i: int, k: mx.array, v: mx.array) -> None:
        """Fit row ``i``'s codecs on its tokens ``(1, H, n, d)`` (what the sequence alone fits on)."""
        H = self.heads
        for which, x in ((0, k), (1, v)):
            arrays = self.base[which].fitted_from(x)
            if not arrays:
                continue
            if self.B > 1:
                old = self.fitted_rows(which)
                arrays = {n: mx.concatenate([a[:i * H], arrays[n], a[(i + 1) * H:]], axis=0) for n, a in old.items()}
            codec = self.base[which].with_fitted(arrays)
            if which:
                self.v_codec = codec
            else:
                self.k_codec = codec
        self.fitted[i] = True

    # -- storing --------------------------------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array, lead=None, real=None) -> None:
        """Store ``keys``/``values`` ``(B, H, T, d)``; row r's real tokens are chunk positions ``lead[r]`` to
        ``lead[r] + real[r]`` (None: every position of every row)."""
        T = keys.shape[2]
        if self.dims is None:
            self.setup(keys.shape[-1], values.shape[-1], keys.shape[1])
        o = self.options
        if lead is None and T == 1 and self.code_step > 1 and self.B and min(self.sink_n) >= o.sink \
                and not self.window and ((self.block > 1 and not self.fits_on_arrival) or all(self.fitted)):
            # (per-token codecs, and a tail coded on the keys' mean, fit on arrival)
            # A decode step (~30 per token): every row's one token joins its tail, without the bookkeeping below.
            if self.B > 1 and self.tail.length == self.tail.capacity:
                self.drop_tail_padding()  # (deferred by `_code_tail`: the copy a full store makes anyway)
            self.tail.append({"k": keys, "v": values})
            self.tail_n = [t + 1 for t in self.tail_n]
            if max(self.tail_n) >= self.exact_keep + self.code_step:  # some row has a step to code
                self._code_tail()
            self.lengths = [n + 1 for n in self.lengths]
            return
        lead = lead or [0] * self.B
        real = real or [T] * self.B
        if self.window:  # as mlx_lm's RotatingKVCache: max_size - 1 old tokens before a multi-token update
            self.evict([self.window[0] - 1 if r > 1 else None for r in real])
        s = [min(max(o.sink - n, 0), r) for n, r in zip(self.sink_n, real)]
        if any(s):
            self._fill_sink(keys, values, lead, s)
        rest = [r - x for r, x in zip(real, s)]
        if self.fits_on_arrival:  # a row's first tail tokens fit its codecs before they are coded
            for i in range(self.B):
                if rest[i] and not self.fitted[i]:
                    lo = lead[i] + s[i]
                    self._fit_row(i, keys[i:i + 1, :, lo:lo + rest[i]], values[i:i + 1, :, lo:lo + rest[i]])
        self._append_tail(keys, values, lead, real, rest)
        self._code_tail()
        self.lengths = [n + r for n, r in zip(self.lengths, real)]
        if self.window:  # ... and max_size after a one-token update
            self.evict([self.window[0] if r == 1 else None for r in real])

    def _fill_sink(self, keys, values, lead, s) -> None:
        """Row r's next ``s[r]`` real tokens (chunk positions from ``lead[r]``) join its sink: one gather."""
        S = self.options.sink
        if self.sink is None:
            self.sink = {n: mx.zeros((self.B, self.heads, S, x.shape[-1]), x.dtype)
                         for n, x in (("k", keys), ("v", values))}
        slot = mx.arange(S, dtype=mx.int32).reshape(1, 1, S, 1)
        old, lo = column(self.sink_n), column(lead)
        src = mx.clip(slot - old + lo, 0, keys.shape[2] - 1)
        new = (slot >= old) & (slot < old + column(s))
        for n, x in (("k", keys), ("v", values)):
            picked = mx.take_along_axis(x, mx.broadcast_to(src, x.shape[:2] + (S, 1)), axis=2)
            self.sink[n] = mx.where(new, picked, self.sink[n]).astype(self.sink[n].dtype)
        self.sink_n = [n + x for n, x in zip(self.sink_n, s)]

    def _write(self, i: int, k: mx.array, v: mx.array) -> None:
        """Row ``i``'s next coded tokens, from its exact ``(1, H, n, d)`` keys and values."""
        self.k_codes.write_row(i, self.coded[i], self.row_codec(0, i).encode(k), self.B)
        self.v_codes.write_row(i, self.coded[i], self.row_codec(1, i).encode(v), self.B)

    def _append_tail(self, keys, values, lead, real, rest) -> None:
        """The chunk joins the tail; rows whose real tokens do not end the chunk (right padding) are rolled so
        that every row's tail is its last ``tail_n`` slots, and pad slots are zeroed (NaN there changes nothing)."""
        T = keys.shape[2]
        shift = [T - a - r for a, r in zip(lead, real)]
        first = {r - x for r, x in zip(real, rest)}
        if not (any(shift) or any(lead)) and len(first) == 1:  # every row's tail tokens end the chunk (one sequence)
            s = first.pop()
            self.tail.append({"k": keys[:, :, s:], "v": values[:, :, s:]} if s else {"k": keys, "v": values})
            self.tail_n = [t + r for t, r in zip(self.tail_n, rest)]
            return
        self.tail.append({"k": keys, "v": values})
        self.tail_n = [t + r for t, r in zip(self.tail_n, rest)]
        view, L = self.tail.live_arrays(), self.tail.length
        valid = mx.arange(L, dtype=mx.int32).reshape(1, 1, L, 1) >= L - column(self.tail_n)
        by = mx.array(shift, dtype=mx.int32)[:, None]
        self.tail.load_raw({n: mx.where(valid, dynamic_roll(a, by, axis=2) if any(shift) else a, 0).astype(a.dtype)
                            for n, a in view.items()})
        self.drop_tail_padding()

    def _code_tail(self) -> None:
        """Rows code their oldest whole steps beyond the exact window and the trim headroom (fitted first, on
        their whole tail, once they hold a token to code or to read as coded: a per-token codec on its first
        tokens after the sink, as when it coded them on arrival)."""
        step, L, o = self.code_step, self.tail.length, self.options
        n_code = [max(t - self.exact_keep, 0) // step * step for t in self.tail_n]
        fit = [not f and (n > 0 or (self.block == 1 and t > o.recent))
               for f, n, t in zip(self.fitted, n_code, self.tail_n)]
        if not (any(n_code) or any(fit)):
            return
        coder = self.tail.coder
        view = self.tail.live_arrays() if coder is not None else self.tail.view()
        for i in range(self.B):
            first = L - self.tail_n[i]
            if fit[i]:
                exact = self.tail.decode({n: a[i:i + 1, :, first:] for n, a in view.items()})
                self._fit_row(i, exact["k"], exact["v"])
            if n_code[i]:
                sl = (slice(i, i + 1), slice(None), slice(first, first + n_code[i]))
                if coder is None:
                    self._write(i, view["k"][sl], view["v"][sl])
                else:  # keys: the block coded from the provisional codes; values: their codes as they are
                    k, v = coder.split({n: a[sl] for n, a in view.items()})
                    self.k_codes.write_row(i, self.coded[i], self.row_codec(0, i).encode(
                        self._tail_key_codec(i).decode(k, mx.float32)), self.B)
                    self.v_codes.write_row(i, self.coded[i], v, self.B)
        self.coded = [c + n for c, n in zip(self.coded, n_code)]
        self.tail_n = [t - n for t, n in zip(self.tail_n, n_code)]
        # A batch's rows code at their own steps: dropping every few slots of padding at once (one copy of the
        # whole tail per coded block) cost more than attending them masked; at most a step of them waits.
        self.drop_tail_padding(1 if self.B == 1 else step)

    def drop_tail_padding(self, at_least: int = 1) -> None:
        """Forget tail slots that are padding in every row, when there are ``at_least`` (one copy of the small
        tail)."""
        pad = min(self.tail.length - t for t in self.tail_n) if self.B else 0
        if pad >= max(at_least, 1):
            # A batch keeps room for a code step: its rows code at their own steps, so its tail grows back by
            # about a step before its next drop (regrown 16 slots at a time, a copy of the whole tail each: 4 per
            # step, +0.8 ms per layer at B=16); a sequence alone codes its whole step at once and keeps one slot.
            self.tail.delete(0, pad, room=self.code_step if self.B > 1 else 1)

    def evict(self, limits) -> None:
        """Row r keeps at most ``limits[r]`` tokens (None: no limit): its oldest after the window's ``keep``
        go, codes first (a hole of skipped slots), then the oldest of its tail."""
        cuts = {}  # row -> (kept tail tokens, tail tokens to drop after them)
        for i, limit in enumerate(limits):
            n = -1 if limit is None else self.sink_n[i] + self.coded[i] - self.gone[i] + self.tail_n[i] - limit
            if n > 0:
                c = min(n, max(self.coded[i] - self.pin - self.gone[i], 0))
                self.gone[i] += c
                kept = min(max(self.pin - self.coded[i], 0), self.tail_n[i])  # a small window: kept ones wait exact
                t = min(n - c, self.tail_n[i] - kept)
                if t > 0:
                    cuts[i] = (kept, t)
        if cuts:
            self._cut_tail(cuts)
        g = min(self.gone, default=0)
        if g >= CODE_STEP and self.k_codes is not None:  # every row has evicted a step: drop it (one copy)
            for store in (self.k_codes, self.v_codes):
                store.drop(self.pin, self.pin + g)
            self.gone = [x - g for x in self.gone]
            self.coded = [x - g for x in self.coded]

    def _cut_tail(self, cuts: Dict[int, tuple]) -> None:
        """Row i drops ``t`` tail tokens after its first ``kept`` ones (``cuts[i] = (kept, t)``); tails stay
        right-aligned (zeros move in on the left)."""
        L, view = self.tail.length, self.tail.live_arrays()
        if all(kept == 0 for kept, _ in cuts.values()):
            for i, (_, t) in cuts.items():
                self.tail_n[i] -= t
        else:
            out = {}
            for n, a in view.items():
                rows = []
                for i in range(self.B):
                    row = a[i:i + 1]
                    if i in cuts:
                        kept, t = cuts[i]
                        lo = L - self.tail_n[i] + kept
                        row = mx.concatenate([mx.zeros(row.shape[:2] + (t,) + row.shape[3:], row.dtype), row[:, :, :lo],
                                              row[:, :, lo + t:]], axis=2)
                    rows.append(row)
                out[n] = rows[0] if self.B == 1 else mx.concatenate(rows, axis=0)
            self.tail.load_raw(out)
            for i, (_, t) in cuts.items():
                self.tail_n[i] -= t
        self.drop_tail_padding()

    def trim(self, n: int) -> None:
        """Drop the ``n`` newest tokens of a single sequence (tail first, then codes, then sink)."""
        if self.B != 1:
            raise ValueError("Rows.trim trims one sequence; a batch trims each row alone (take_rows / concat_rows)")
        t = min(n, self.tail_n[0])
        self.tail.trim(t)
        self.tail_n[0] -= t
        left = n - t
        live = self.coded[0] - self.gone[0]
        if left and live:
            if self.gone[0] and left > self.coded[0] - self.pin - self.gone[0]:
                raise ValueError("cannot trim into the kept prefix of a sliding window that has evicted tokens")
            drop = min(left, live)
            cut = (self.coded[0] - drop) // self.block * self.block
            survivors = self.coded[0] - drop - cut
            if survivors:  # a cut block: its surviving tokens return to the tail as they decode
                dtype = self.tail.dtype("k")
                k, v = (c.decode(s.row_view(0, cut, cut + self.block), dtype)
                        for c, s in ((self.k_codec, self.k_codes), (self.v_codec, self.v_codes)))
            self.coded[0] = cut
            if self.block > 1:  # a block store stays exactly full
                self.k_codes.truncate(cut)
                self.v_codes.truncate(cut)
            if survivors:
                self.tail.append({"k": k[:, :, :survivors], "v": v[:, :, :survivors]})
                self.tail_n[0] += survivors
            left -= drop
        self.sink_n[0] -= min(left, self.sink_n[0])
        self.lengths[0] -= n

    # -- attention parts ------------------------------------------------------------------------------
    def part_sizes(self):
        return (max(self.sink_n) if self.sink is not None else 0, max(self.coded, default=0), self.tail.length)

    def _old_tail(self, L: int) -> int:
        """Tail slots read through a round trip (per-token codecs with an exact window: all but the last
        ``recent``); block codecs keep their whole tail exact until its blocks are coded."""
        r = self.options.recent
        return L - r if self.block == 1 and r and L > r else 0

    def attention_parts(self, lockstep: bool = False) -> list:
        """Every row's tokens as attention parts ``[sink | codes | tail]``, folded ``(1, B*H, ...)`` (the folded
        codecs' per-head parameters are per sequence); which slots each row holds is `part_masks`'. ``lockstep``:
        every row holds the same slots (sequences stored together, as mlx_lm's KVCache holds them): the codes skip
        a window's evicted slots instead of leaving them to a mask."""
        S, C, L = self.part_sizes()
        parts: list = []
        if S:
            parts.append(self._sink_part(S))
        if C:
            k, v, g = self.k_codes.folded(C), self.v_codes.folded(C), self.gone[0]
            spans = [(0, min(self.pin, C)), (self.pin + g, C)] if lockstep and g else [(0, C)]
            spans = [(lo, hi) for lo, hi in spans if hi > lo]
            whole = self._coded_part(self.k_codec, k, self.v_codec, v) if len(spans) > 1 else None
            for lo, hi in spans:
                kk, vv = (k, v) if (lo, hi) == (0, C) else (self.k_codec.slice_tokens(k, lo, hi),
                                                            self.v_codec.slice_tokens(v, lo, hi))
                parts.append(self._coded_part(self.k_codec, kk, self.v_codec, vv))
                parts[-1].within = None if whole is None else (whole, lo, hi)  # (the kernel: one pass)
        if L:
            t = {n: fold(a) for n, a in self.tail.buffers.items()}
            if L < self.tail.capacity:
                t = {n: a[:, :, :L] for n, a in t.items()}
            old = self._old_tail(L)
            if old:
                parts.append(CodedPart(self.k_codec, self.k_codec.encode(t["k"][:, :, :old]),
                                       self.v_codec, self.v_codec.encode(t["v"][:, :, :old])))
                t = {n: a[:, :, old:] for n, a in t.items()}
            parts.append(ExactPart(t["k"], t["v"]))
        return parts

    def _coded_part(self, k_codec, k_arrays, v_codec, v_arrays) -> CodedPart:
        """The same `CodedPart` object while its codecs and code views are the same objects: decode steps between
        two coded blocks reuse it, and what the compiled attention derives from it (`kernel.decode_step`). Kept
        with the views, so it goes when the codes change (never holding superseded arrays alive)."""
        key = ("part", id(k_arrays), id(v_arrays))
        part = self.k_codes._views.get(key)
        if part is None or part.k_arrays is not k_arrays or part.v_arrays is not v_arrays or \
                part.k_codec is not k_codec or part.v_codec is not v_codec or self.v_codes._views.get(key) is not part:
            part = CodedPart(k_codec, k_arrays, v_codec, v_arrays)
            for store in (self.k_codes, self.v_codes):
                store._bound_views()
                store._views[key] = part
        return part

    def _sink_part(self, S: int) -> ExactPart:
        """The sink's first ``S`` slots, folded; kept while the sink arrays are the same objects."""
        k, v = self.sink["k"], self.sink["v"]
        last = self._sink_views
        if last is not None and last[0] is k and last[1] is v and last[2] == S:
            return last[3]
        part = ExactPart(*(fold(a if S == a.shape[2] else a[:, :, :S]) for a in (k, v)))
        self._sink_views = (k, v, S, part)
        return part

    def part_masks(self) -> Optional[List[Optional[mx.array]]]:
        """One entry per `attention_parts` part: bool ``(B, 1, 1, n)``, True on each row's stored tokens, or None
        where every row fills the part; None when no part has a pad slot."""
        S, C, L = self.part_sizes()
        old = self._old_tail(L)
        lo_tail = [L - t for t in self.tail_n]
        spans = [(S, [0] * self.B, self.sink_n, None), (C, [0] * self.B, self.coded, self.gone),
                 (old, lo_tail, [old] * self.B, None), (L - old, [x - old for x in lo_tail], [L - old] * self.B, None)]
        masks = []
        for n, lo, hi, hole in spans:
            if not n:
                continue
            if any(lo) or any(h != n for h in hi) or (hole and any(hole)):
                slot = mx.arange(n, dtype=mx.int32).reshape(1, 1, 1, n)
                m = (slot >= column(lo)) & (slot < column(hi))
                if hole and any(hole):
                    m &= (slot < self.pin) | (slot >= self.pin + column(hole))
                masks.append(m)
            else:
                masks.append(None)
        return masks if any(m is not None for m in masks) else None

    def row_parts(self, i: int) -> list:
        """Row ``i``'s stored tokens alone, ``[sink | codes | tail]`` with its own codecs: exactly the parts the
        sequence alone attends (views, no pad slot, no evicted slot)."""
        parts: list = []
        one = self.B == 1
        if self.sink_n[i]:
            n = self.sink_n[i]
            parts.append(ExactPart(*((a if n == a.shape[2] else a[:, :, :n]) if one else a[i:i + 1, :, :n]
                                     for a in (self.sink["k"], self.sink["v"]))))
        coded, gone = self.coded[i], self.gone[i]
        spans = [(lo, hi) for lo, hi in ([(0, min(self.pin, coded)), (self.pin + gone, coded)] if gone else
                                         [(0, coded)]) if hi > lo]
        whole = self._coded_part(self.row_codec(0, i), self.k_codes.row_view(i, 0, coded), self.row_codec(1, i),
                                 self.v_codes.row_view(i, 0, coded)) if len(spans) > 1 else None
        for lo, hi in spans:
            parts.append(self._coded_part(self.row_codec(0, i), self.k_codes.row_view(i, lo, hi),
                                          self.row_codec(1, i), self.v_codes.row_view(i, lo, hi)))
            parts[-1].within = None if whole is None else (whole, lo, hi)  # (the kernel: one pass)
        if self.tail_n[i] and self.tail.coder is not None:
            # a coded tail is one more coded part (provisional keys, values as coded): the kernel decodes it each
            # step beside the exact tokens (`kernel.DECODED_PART_TOKENS`), the reference reads it like any codes
            L, coder = self.tail.length, self.tail.coder
            store = self.tail.raw
            memo = getattr(self, "_tail_parts", {}).get(i)
            # the same part while the tail is unchanged (attention asks for the parts more than once a step)
            if memo is None or memo[0] != (L, self.tail_n[i], store.writes) or memo[1] is not store:
                raw = {n: a[:, :, L - self.tail_n[i]:L] if one else a[i:i + 1, :, L - self.tail_n[i]:L]
                       for n, a in self.tail.raw.buffers.items()}
                ks, vs = coder.split(raw)
                memo = ((L, self.tail_n[i], store.writes), store,
                        CodedPart(self._tail_key_codec(i), ks, coder.v, vs))
                self._tail_parts = {**getattr(self, "_tail_parts", {}), i: memo}
            parts.append(memo[2])
        elif self.tail_n[i]:
            L = self.tail.length
            t = {n: a[:, :, L - self.tail_n[i]:L] if one else a[i:i + 1, :, L - self.tail_n[i]:L]
                 for n, a in self.tail.buffers.items()}
            old = max(self.tail_n[i] - self.options.recent, 0) if self.block == 1 and self.options.recent else 0
            if old:
                kc, vc = self.row_codec(0, i), self.row_codec(1, i)
                parts.append(CodedPart(kc, kc.encode(t["k"][:, :, :old]), vc, vc.encode(t["v"][:, :, :old])))
            parts.append(ExactPart(t["k"][:, :, old:], t["v"][:, :, old:]) if old else ExactPart(t["k"], t["v"]))
        return parts

    # -- bytes and copies -----------------------------------------------------------------------------
    def arrays(self) -> List[mx.array]:
        out = list(self.sink.values()) if self.sink is not None else []
        out += list(self.tail.raw.buffers.values())
        for store, codec in ((self.k_codes, self.k_codec), (self.v_codes, self.v_codec)):
            if store is not None:
                out += list(store.arrays.values()) + list(codec.fitted_arrays().values())
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every array held (codes with their free slots, exact windows, fitted parameters)."""
        return sum(a.nbytes for a in self.arrays())

    def copy(self) -> "Rows":
        """An independent copy: later writes to either do not show in the other (codecs are never mutated)."""
        new = copy.copy(self)
        for name in COUNTS + ("fitted",):
            setattr(new, name, list(getattr(self, name)))
        new.tail, new._sink_views = self.tail.copy(), None
        if self.sink is not None:
            new.sink = {n: copy.copy(a) for n, a in self.sink.items()}
        if self.k_codes is not None:
            new.k_codes, new.v_codes = self.k_codes.copy(), self.v_codes.copy()
        return new


# -- rows in, rows out: what merge / extend / filter / extract / trim and saved states are made of ------------
def take_rows(rows: Rows, idx: Sequence[int]) -> Rows:
    """A new `Rows` of the sequences ``idx`` (in that order), independent of ``rows`` (later writes to either do not
    show in the other), holding only the slots its tokens need."""
    if rows.dims is not None and idx and list(idx) == list(range(rows.B)):
        # Every row in order (a served batch of one: extract and filter, once per request each): a copy, not a
        # gather of every array (mlx_lm's extract: 0.87 instead of 2.78 ms for 30 layers at 200 tokens).
        out = rows.copy()
        for store in (out.k_codes, out.v_codes):
            store.truncate(max(out.coded))
        out.drop_tail_padding()
        return out
    out = Rows(rows.options, len(idx), rows.window)
    for name in COUNTS + ("fitted",):
        setattr(out, name, [getattr(rows, name)[i] for i in idx])
    if rows.dims is None or not idx:
        return out
    out.setup(*rows.dims, rows.heads)
    return _take(rows, list(idx), out)


def _take(rows: Rows, idx: List[int], out: Rows) -> Rows:
    """`take_rows` into ``out`` (set up, counts copied): the slots the rows ``idx`` need, sliced, then gathered:
    one copy of each array (mlx_lm's `extract` and `filter`, once per finished request; a gather of whole rows
    then a truncation and a padding drop copied up to three times)."""
    # A gather always writes a buffer of its own (`mx.contiguous` of a row slice may keep the batch's alive). Every
    # array in one `gather_rows` (one compiled operation, where it runs: a dozen arrays per layer, ~0.2 ms of
    # graph operations at 8 rows when taken one by one).
    sink = list(rows.sink.items()) if rows.sink is not None else []
    codes = []
    for src, dst in ((rows.k_codes, out.k_codes), (rows.v_codes, out.v_codes)):
        cap = min(_round_up(max(out.coded), src.grow), src.capacity)
        kept = (src.arrays if cap == src.capacity else src.codec.slice_tokens(src.arrays, 0, cap)) if cap else {}
        codes.append((dst, cap, list(kept.items())))
    L, n = rows.tail.length, max(out.tail_n)
    out.tail.dtypes = dict(rows.tail.dtypes)
    tail = [(k, a[:, :, L - n:L]) for k, a in rows.tail.raw.buffers.items()] if n else []  # right-aligned: last n
    fitted = [(which, list(arrays.items())) for which, arrays in enumerate(
        c.fitted_arrays() for c in (rows.k_codec, rows.v_codec)) if arrays and (out.B > 1 or out.fitted[0])]
    per_row = [a for _, a in sink] + [a for _, _, kv in codes for _, a in kv] + [a for _, a in tail]
    folded = [a for _, kv in fitted for _, a in kv]  # (B*H, ...): H rows per sequence
    got = iter(gather_rows(per_row + folded, idx, [1] * len(per_row) + [rows.heads] * len(folded)))
    if sink:
        out.sink = {name: next(got) for name, _ in sink}
    for dst, cap, kv in codes:
        if cap:
            dst.arrays, dst.capacity = {f: next(got) for f, _ in kv}, cap
    if tail:
        out.tail.load_raw({k: next(got) for k, _ in tail})
    for which, kv in fitted:
        codec = rows.base[which].with_fitted({k: next(got) for k, _ in kv})
        out.k_codec, out.v_codec = (codec, out.v_codec) if which == 0 else (out.k_codec, codec)
    return out


def concat_rows(parts: Sequence[Rows]) -> Rows:
    """One `Rows` holding every row of ``parts`` in order (each store padded to the largest; tails stay
    right-aligned); ``parts`` are unchanged."""
    parts = [p for p in parts if p.B]
    first = parts[0]
    if len(parts) == 1:
        # One sequence (mlx_lm merges a served request's cache alone: once per request): new objects over the
        # same data (copy-on-write, as `Rows.copy`), not a copy of every array (7.9 instead of ~1 ms, 30 layers).
        return first.copy()
    out = Rows(first.options, sum(p.B for p in parts), first.window)
    for name in COUNTS + ("fitted",):
        setattr(out, name, [x for p in parts for x in getattr(p, name)])
    filled = [p for p in parts if p.dims is not None]
    if not filled:
        return out
    dims, heads = filled[0].dims, filled[0].heads
    if any(p.dims != dims or p.heads != heads for p in filled):
        raise ValueError("caches to merge must share head dims and KV heads")
    out.setup(*dims, heads)
    held = [a for p in filled for a in ([*p.sink.values()] if p.sink is not None else [])]
    dtype = held[0].dtype if held else next((p.tail.dtype("k") for p in filled if p.tail.dtypes), mx.float32)
    out.tail.dtypes = next((dict(p.tail.dtypes) for p in filled if p.tail.dtypes), {})
    S, L = first.options.sink, max(p.tail.length for p in filled)

    def exact(p: Rows, n: str, d, size: int, right: bool, dt=None) -> mx.array:  # (rows, H, size, *d), zeros padded
        a = p.sink[n] if not right and p.sink is not None else \
            (p.tail.live_arrays()[n] if right and p.tail.length else None)
        pad = size - (0 if a is None else a.shape[2])
        if not pad:
            return a
        z = mx.zeros((p.B, heads, pad) + tuple(d if isinstance(d, tuple) else (d,)),
                     a.dtype if a is not None else (dt or dtype))
        return z if a is None else mx.concatenate([z, a] if right else [a, z], axis=2)

    cat = lambda xs: xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=0)  # noqa: E731
    if S and any(p.sink is not None for p in filled):
        out.sink = {n: cat([exact(p, n, d, S, False) for p in parts]) for n, d in zip("kv", dims)}
    if L:  # (every part's tail is of the layout's one kind: `setup` picks it from the options)
        out.tail.load_raw({n: cat([exact(p, n, trailing, L, True, dt) for p in parts])
                           for n, (trailing, dt) in out.tail.fields(dims).items()})
    for name in ("k_codes", "v_codes"):
        store = getattr(out, name)
        cap = max(getattr(p, name).capacity if p.dims is not None else 0 for p in parts)
        if cap:
            pieces = [getattr(p, name).padded(p.B, cap) if p.dims is not None else store.zeros(p.B, cap) for p in parts]
            store.arrays = {f: cat([x[f] for x in pieces]) for f in store.layout}
            store.capacity = cap
    for which in (0, 1):
        if out.B == 1:
            codec = (first.k_codec, first.v_codec)[which]
        else:
            blank = _layouts(out.options, dims, heads)[2][which]
            rows = [p.fitted_rows(which) if p.dims is not None else
                    {n: mx.concatenate([a] * p.B, axis=0) for n, a in blank.items()} for p in parts]
            codec = out.base[which].with_fitted({n: cat([r[n] for r in rows]) for n in blank}) if blank \
                else out.base[which]
        out.k_codec, out.v_codec = (codec, out.v_codec) if which == 0 else (out.k_codec, codec)
    return out


def row_arrays(rows: Rows, i: int) -> Dict[str, Dict[str, mx.array]]:
    """Row ``i``'s live arrays as a single sequence's saved state holds them: ``sink``, ``k_codes``, ``v_codes``,
    ``tail`` (exact ``{"k", "v"}``), ``k_fit`` / ``v_fit`` (empty before its fit)."""
    if rows.dims is None:
        return {n: {} for n in ("sink", "k_codes", "v_codes", "tail", "k_fit", "v_fit")}
    pick = (lambda a: a) if rows.B == 1 else (lambda a: a[i:i + 1])  # noqa: E731
    L, n_tail = rows.tail.length, rows.tail_n[i]
    out = {
        "sink": {n: pick(a)[:, :, :rows.sink_n[i]] for n, a in rows.sink.items()} if rows.sink_n[i] else {},
        "tail": {n: pick(a)[:, :, L - n_tail:L] for n, a in rows.tail.live_arrays().items()} if n_tail else {},
    }
    for name, store in (("k_codes", rows.k_codes), ("v_codes", rows.v_codes)):
        out[name] = store.row_live(i, rows.pin, rows.gone[i], rows.coded[i])
    for name, which in (("k_fit", 0), ("v_fit", 1)):
        out[name] = rows.row_codec(which, i).fitted_arrays() if rows.fitted[i] else {}
    return out


def rows_from_arrays(options, window, dims, arrays: Dict[str, Dict[str, mx.array]], length: int) -> Rows:
    """The `Rows` of `row_arrays` output (already checked against ``options`` and ``dims``): one sequence, or
    several in lockstep (arrays ``(B, ...)``; fitted parameters ``(B*H, ...)``, or ``(H, ...)`` shared by all)."""
    held = [a for n in ("sink", "tail", "k_codes", "v_codes") for a in arrays.get(n, {}).values()]
    fits = [a for n in ("k_fit", "v_fit") for a in arrays.get(n, {}).values()]
    B, H = tuple(held[0].shape[:2]) if held else (1, fits[0].shape[0] if fits else None)
    rows = Rows(options, B, window)
    rows.lengths = [length] * B
    if dims is None or H is None:  # (nothing stored, nothing fitted: as a fresh cache)
        return rows
    rows.setup(*dims, H)
    if arrays["sink"]:
        n = arrays["sink"]["k"].shape[2]
        rows.sink = {f: mx.concatenate([a, mx.zeros(a.shape[:2] + (options.sink - n, a.shape[3]), a.dtype)], axis=2)
                     if n < options.sink else mx.array(a) for f, a in arrays["sink"].items()}
        rows.sink_n = [n] * B
    if arrays["sink"]:
        rows.tail.dtypes = {n: arrays["sink"][n].dtype for n in ("k", "v") if n in arrays["sink"]}
    if arrays["tail"]:
        rows.tail.load_raw({f: mx.array(a) for f, a in arrays["tail"].items()})
        if rows.tail.coder is None:
            rows.tail.dtypes = {n: a.dtype for n, a in arrays["tail"].items()}
        rows.tail_n = [rows.tail.length] * B
    for store, name in ((rows.k_codes, "k_codes"), (rows.v_codes, "v_codes")):
        if arrays[name]:
            store.arrays, store.capacity = dict(arrays[name]), store.codec.n_tokens(arrays[name])
    rows.coded = [rows.k_codes.capacity] * B
    if arrays["k_fit"] or arrays["v_fit"] or not (rows.base[0].blank_fitted(1) or rows.base[1].blank_fitted(1)):
        for which, name in ((0, "k_fit"), (1, "v_fit")):
            fit = arrays[name]
            if B > 1 and fit and next(iter(fit.values())).shape[0] == H:  # one fit shared by every sequence
                fit = {n: mx.concatenate([a] * B, axis=0) for n, a in fit.items()}
            codec = rows.base[which].with_fitted(fit)
            rows.k_codec, rows.v_codec = (codec, rows.v_codec) if which == 0 else (rows.k_codec, codec)
        rows.fitted = [True] * B
    return rows
