"""`Rows`: the one storage engine behind every packed cache. A single sequence is a batch of one.

Each row (sequence) ``i`` keeps, in temporal order, ``[sink | codes | tail]``:

- sink ``(B, H, S, d)`` exact: row i's first ``sink_n[i]`` tokens, left-aligned (``S = options.sink``);
- codes (one `RowCodes` per codec, the codec's declared layout): row i's coded tokens in slots ``[0, coded[i])``,
  blocks counted from the row's own first coded token (a row codes the same token sets as it would alone). A
  sliding window evicts the oldest codes after its ``keep`` prefix: slots ``[pin, pin + gone[i])`` are a hole,
  never attended (``pin = keep - sink``), dropped for every row at once when all rows have evicted enough;
- tail ``(B, H, L, d)``: row i's newest ``tail_n[i]`` tokens, right-aligned (new tokens arrive at the end
  for every row); exact, or, for a layout that codes the tokens waiting for their key block (`TailCoder`), coded
  per token from the moment any row has coded a block (`sync_tail`: until then a short chat attends exactly as
  mlx_lm's own cache). The tail holds the last ``recent`` tokens plus up to ``trim_headroom`` older ones (read through
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
from typing import Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import dynamic_roll

from veloxquant_mlx.cache.row_codes import CodedTail, RowCodes, TailCoder, _layouts, column
from veloxquant_mlx.cache.row_views import RowViews
from veloxquant_mlx.quant.rope import fit_mean, offset_keys, rotate

CODE_STEP = 256  # code slots added at a time for per-token codecs (block codecs grow one block at a time)
TAIL_STEP = 16  # exact tail slots added at a time
COUNTS = ("lengths", "sink_n", "gone", "coded", "tail_n")  # per-row token counts


class Rows(RowViews):
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
        self.tail = CodedTail(TAIL_STEP)  # exact, or coded once a row codes a block (`sync_tail`)
        self.tail_coder = None  # the layout's `TailCoder` (None: the tail stays exact), unbound; `setup` sets it
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
        """Whether rows fit before their first token after the sink is stored (a tail coded on the fitted key
        mean, or keys stored less their mean before RoPE: ``rope_offset``)."""
        coder = self.tail_coder
        return (coder is not None and coder.centred) or self.rope is not None

    @property
    def rope(self):
        """The layer's `RopeFrame` when keys are stored less their rotated mean (``options.rope_offset``): every
        key after a row's fit is stored as ``k_t - R_t mu`` (sink, tail and codes alike, so moving tokens between
        stores changes nothing), and attention adds ``R_t mu`` back (`rope_mu`), ``t`` the token's place in its
        row: the RoPE position mlx_lm gives it (the caches' offsets count stored tokens)."""
        memo = getattr(self, "_rope", None)
        if memo is None or memo[0] is not self.options:
            memo = self._rope = (self.options, None if self.window else self.options.rope_frame)
        return memo[1]

    def rope_mu(self, i: Optional[int] = None) -> Optional[mx.array]:
        """Every row's fitted mean before RoPE ``(B*H, d)`` float16 (row ``i``'s ``(H, d)``; zeros for rows not
        fitted yet: their keys are stored as they came), or None without ``rope_offset``."""
        if self.rope is None or self.dims is None:
            return None
        mu = getattr(self.k_codec, "rope_mean", None)
        if mu is None:
            mu = mx.zeros((self.B * self.heads, self.dims[0]), dtype=mx.float16)
        return mu if i is None or self.B == 1 else mu[i * self.heads:(i + 1) * self.heads]

    def _less_step_offset(self, keys: mx.array) -> mx.array:
        """`_less_offset` of a decode step's keys ``(B, H, 1, d)`` (each row's next position): from a table of the
        next `STEP_TABLE` positions' offsets, kept while ``mu`` stays and the rows step together."""
        mu, lengths = self.rope_mu(), self.lengths
        memo = getattr(self, "_step_offsets", None)
        k = lengths[0] - memo[1][0] if memo is not None and memo[0] is mu and len(memo[1]) == len(lengths) else -1
        if not (0 <= k < self.STEP_TABLE and all(n - b == k for n, b in zip(lengths, memo[1]))):
            B, H, _, d = keys.shape
            starts = mx.repeat(mx.array(lengths, dtype=mx.int32), H)
            memo = self._step_offsets = (mu, list(lengths),
                                         offset_keys(mu, starts, self.STEP_TABLE, self.rope).reshape(B, H, -1, d))
            k = 0
        return (keys.astype(mx.float32) - memo[2][:, :, k:k + 1]).astype(keys.dtype)

    STEP_TABLE = 64  # decode steps' offsets computed at a time

    def _less_offset(self, keys: mx.array, positions: mx.array, mu: Optional[mx.array] = None) -> mx.array:
        """``keys`` ``(B, H, T, d)`` less ``R_t mu`` of their rows at ``positions`` ``(B, T)``, in their dtype."""
        mu = self.rope_mu() if mu is None else mu
        B, H, T, d = keys.shape
        rot = rotate(mx.broadcast_to(mu.reshape(B, H, 1, d), (B, H, T, d)), positions[:, None, :], self.rope)
        return (keys.astype(mx.float32) - rot).astype(keys.dtype)

    def sync_tail(self) -> None:
        """The tail's kind follows the rows' codes: exact while no row has coded a block (a short chat attends
        exactly as mlx_lm's cache, the first block is coded from exact tokens), the layout's per-token codes from
        the first coded block on (the budget holds at every length after it), exact again when a trim removes every
        block. The tokens move between kinds once: coded from exact, or decoded (as attention read them)."""
        coder = self.tail_coder if self.tail_coder is not None and any(self.coded) else None
        if coder is not None and coder.centred and self.k_codec is not None:
            coder = coder.bound(self.k_codec)
        current = self.tail.coder
        if current is None and coder is None:
            return
        if current is not None and coder is not None:
            if current.centred and current.key_codec is not self.k_codec:
                self.tail.coder = coder  # (the same codes: only the rows' folded means object changed)
            return
        if not self.tail.length:
            self.tail.coder = coder
            self.tail.load_raw({})  # (no arrays of the other kind's fields)
            return
        raw = self.tail.live_arrays()
        exact = raw if current is None else current.decode(raw, {n: self.tail.dtype(n) for n in "kv"})
        self.tail.coder = coder
        if coder is None:
            self.tail.load_raw(exact)
        else:
            self.tail.load(exact)

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
        if self.options.rope_offset is True:  # ("auto": where the layer's RoPE is known, not in a window)
            if self.window:
                raise ValueError("rope_offset applies to full-attention caches: a sliding window's slots are not "
                                 "its tokens' positions (the builder leaves window layers without it)")
            if self.options.key_rope is None:
                raise ValueError("rope_offset=True needs the layer's RoPE (key_rope): build the caches with "
                                 "veloxquant_mlx.enable(model) or make_prompt_cache(model, ...), which read it")
            if self.rope.dims > k_dim:
                raise ValueError(f"key_rope rotates {self.rope.dims} dims, but keys have head_dim {k_dim}")
        self.base, layouts, _ = _layouts(self.options, (k_dim, v_dim), heads)
        self.dims, self.heads = (k_dim, v_dim), heads
        # With block keys, values arrive a whole block at a time: growing by one block keeps their store exactly
        # full, so attention reads whole contiguous arrays (no slice, no copy inside the quantized matmul).
        grow = self.block if self.block > 1 else CODE_STEP
        self.k_codes, self.v_codes = (RowCodes(c, lay, grow) for c, lay in zip(self.base, layouts))
        self.tail_coder = TailCoder.for_codecs(self.options, self.base) if not self.window else None
        if not self.tail.length:  # exact until a row codes a block (`sync_tail`); restores load their kind after this
            self.tail.coder = None
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

    def _fit_row(self, i: int, k: mx.array, v: mx.array, start: Optional[int] = None) -> None:
        """Fit row ``i``'s codecs on its tokens ``(1, H, n, d)`` (what the sequence alone fits on), the first at
        position ``start``. With ``rope_offset``, first its mean before RoPE, on them: the codecs then fit on the keys
        less it, and the row's sink (stored before) is converted."""
        H = self.heads
        mu = None
        if self.rope is not None:
            if start is None:
                raise RuntimeError("Rows: a row with rope_offset fits on arrival, where its positions are known")
            mu = fit_mean(k, start, self.rope).astype(mx.float16)  # (as stored: what is subtracted is added back)
            k = self._less_offset(k, (mx.arange(k.shape[2]) + start)[None], mu)
            if self.sink is not None and self.sink_n[i]:
                n, S = self.sink_n[i], self.sink["k"].shape[2]
                row = self.sink["k"][i:i + 1]
                less = self._less_offset(row, mx.arange(S)[None], mu)
                keep = (mx.arange(S) < n).reshape(1, 1, S, 1)
                self.sink["k"] = mx.concatenate([self.sink["k"][:i], mx.where(keep, less, row),
                                                 self.sink["k"][i + 1:]], axis=0) if self.B > 1 else \
                    mx.where(keep, less, row)
        for which, x in ((0, k), (1, v)):
            arrays = self.base[which].fitted_from(x)
            if mu is not None and not which:
                arrays["rope_mean"] = mu
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
        if lead is None and T == 1 and self.code_step == 1 and self.block == 1 and self.B == 1 and self.coded[0] \
                and not self.tail_n[0] and not (o.recent or self.window) and self.sink_n[0] >= o.sink \
                and self.fitted[0]:
            # A decode step of a per-token codec coding every token on arrival (code_batch 1): straight to the
            # codes, as `_code_tail` would store it, without the tail's bookkeeping (~0.4 ms per layer).
            if self.rope is not None:
                keys = self._less_step_offset(keys)
            self._write(0, keys, values)
            self.coded[0] += 1
            self.lengths[0] += 1
            return
        if lead is None and T == 1 and self.code_step == 1 and self.block == 1 and self.B > 1 and all(self.coded) \
                and not any(self.tail_n) and not (o.recent or self.window) and min(self.sink_n) >= o.sink \
                and all(self.fitted) and self._codes_need_no_row():
            # ... of a batch: every row's token coded in one call (codes depend on no row's fitted arrays) and
            # written at each row's next slot, instead of one encode per row through the tail
            if self.rope is not None:
                keys = self._less_step_offset(keys)
            self.k_codes.write_rows(self.coded, self.base[0].encode(keys), self.B)
            self.v_codes.write_rows(self.coded, self.base[1].encode(values), self.B)
            self.coded = [c + 1 for c in self.coded]
            self.lengths = [n + 1 for n in self.lengths]
            return
        if lead is None and T == 1 and self.code_step > 1 and self.B and min(self.sink_n) >= o.sink \
                and not self.window and ((self.block > 1 and not self.fits_on_arrival) or all(self.fitted)):
            # (per-token codecs, and a tail coded on the keys' mean, fit on arrival)
            # A decode step (~30 per token): every row's one token joins its tail, without the bookkeeping below.
            if self.B > 1 and self.tail.length == self.tail.capacity:
                self.drop_tail_padding()  # (deferred by `_code_tail`: the copy a full store makes anyway)
            if self.rope is not None:
                keys = self._less_step_offset(keys)
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
        raw, fitted_before = keys, list(self.fitted)
        if self.rope is not None:  # (chunk position t of row r is its token lengths[r] - lead[r] + t)
            positions = mx.array([n - a for n, a in zip(self.lengths, lead)], dtype=mx.int32)[:, None] + mx.arange(T)
            if any(fitted_before):  # rows fitted before: every new key stored less its offset, sink included
                keys = self._less_offset(raw, positions)
        if any(s):
            self._fill_sink(keys, values, lead, s)
        rest = [r - x for r, x in zip(real, s)]
        if self.fits_on_arrival:  # a row's first tail tokens fit its codecs before they are coded
            for i in range(self.B):
                if rest[i] and not self.fitted[i]:
                    lo = lead[i] + s[i]
                    self._fit_row(i, raw[i:i + 1, :, lo:lo + rest[i]], values[i:i + 1, :, lo:lo + rest[i]],
                                  self.lengths[i] + s[i])
        if self.rope is not None and self.fitted != fitted_before:  # rows fitted now: their tail tokens too
            keys = self._less_offset(raw, positions)
        self._append_tail(keys, values, lead, real, rest)
        self._code_tail()
        self.lengths = [n + r for n, r in zip(self.lengths, real)]
        if self.window:  # ... and max_size after a one-token update
            self.evict([self.window[0] if r == 1 else None for r in real])

    def _codes_need_no_row(self) -> bool:
        """Whether a token's codes are the same whichever row's codec codes it: no fitted array the encoding reads
        (``rope_mean`` is subtracted before encoding, by the cache)."""
        memo = getattr(self, "_rowless", None)
        if memo is None:
            memo = self._rowless = not (set(self.base[0].blank_fitted(1)) - {"rope_mean"}
                                        or self.base[1].blank_fitted(1))
        return memo

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
        if o.code_from:  # rows still short keep every token exact (their count after this update)
            n_code = [n if c or s + t >= o.code_from else 0
                      for n, c, s, t in zip(n_code, self.coded, self.sink_n, self.tail_n)]
        fit = [not f and (n > 0 or (self.block == 1 and t > o.recent))
               for f, n, t in zip(self.fitted, n_code, self.tail_n)]
        if not (any(n_code) or any(fit)):
            return
        coder = self.tail.coder
        view = self.tail.live_arrays() if coder is not None else self.tail.view()
        for i in range(self.B):
            first = L - self.tail_n[i]
            if fit[i]:  # (not with rope_offset: its rows fit on arrival)
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
        self.sync_tail()
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
            self.sync_tail()  # (no block left: the survivors join an exact tail as they decode, no second rounding)
            if survivors:
                self.tail.append({"k": k[:, :, :survivors], "v": v[:, :, :survivors]})
                self.tail_n[0] += survivors
            left -= drop
        self.sink_n[0] -= min(left, self.sink_n[0])
        self.lengths[0] -= n
        self.sync_tail()

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
