"""Rows in, rows out (`Rows`: :mod:`veloxquant_mlx.cache.row_policy`): a batch's rows taken (`take_rows`), batches
joined (`concat_rows`), one row's arrays as a saved state holds them (`row_arrays`) and back (`rows_from_arrays`),
a batch's arrays as stored back into rows (`batch_rows_from_arrays`): the public constructors the saved states
(:mod:`veloxquant_mlx.cache.saved_state`) build `Rows` with.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import mlx.core as mx

from veloxquant_mlx.attention.kernel import gather_rows
from veloxquant_mlx.cache.row_codes import _layouts
from veloxquant_mlx.quant.slot_store import round_up
from veloxquant_mlx.cache.row_policy import COUNTS, Rows


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
        cap = min(round_up(max(out.coded), src.grow), src.capacity)
        kept = (src.arrays if cap == src.capacity else src.slice_tokens(src.arrays, 0, cap)) if cap else {}
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
            dst.arrays = {f: next(got) for f, _ in kv}  # (cap slots)
    if tail:
        out.tail.coder = rows.tail.coder  # (the rows' kind; rebound to these rows and synced below)
        out.tail.load_raw({k: next(got) for k, _ in tail})
    for which, kv in fitted:
        codec = rows.base[which].with_fitted({k: next(got) for k, _ in kv})
        out.k_codec, out.v_codec = (codec, out.v_codec) if which == 0 else (out.k_codec, codec)
    out.sync_tail()
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

    def exact(p: Rows, n: str, d, size: int, right: bool, dt=None, tail=None) -> mx.array:  # (rows, H, size, *d)
        a = p.sink[n] if not right and p.sink is not None else (tail[n] if right and tail else None)  # zeros padded
        pad = size - (0 if a is None else a.shape[2])
        if not pad:
            return a
        z = mx.zeros((p.B, heads, pad) + tuple(d if isinstance(d, tuple) else (d,)),
                     a.dtype if a is not None else (dt or dtype))
        return z if a is None else mx.concatenate([z, a] if right else [a, z], axis=2)

    cat = lambda xs: xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=0)  # noqa: E731
    if S and any(p.sink is not None for p in filled):
        out.sink = {n: cat([exact(p, n, d, S, False) for p in parts]) for n, d in zip("kv", dims)}
    if L:  # every part's tail in the kind the joined rows hold (`Rows.sync_tail`): coded once any row has a block
        coded = out.tail_coder is not None and any(out.coded)
        out.tail.coder = out.tail_coder if coded else None
        tails = {id(p): _tail_as(p, coded) for p in filled}
        out.tail.load_raw({n: cat([exact(p, n, trailing, L, True, dt, tails.get(id(p))) for p in parts])
                           for n, (trailing, dt) in out.tail.fields(dims).items()})
    for name in ("k_codes", "v_codes"):
        store = getattr(out, name)
        cap = max(getattr(p, name).capacity if p.dims is not None else 0 for p in parts)
        if cap:
            pieces = [getattr(p, name).padded(p.B, cap) if p.dims is not None else store.zeros(p.B, cap) for p in parts]
            store.arrays = {f: cat([x[f] for x in pieces]) for f in store.layout}  # (cap slots)
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
    out.sync_tail()
    return out


def _tail_as(rows: Rows, coded: bool) -> Dict[str, mx.array]:
    """``rows``' live tail arrays as exact ``{"k", "v"}`` (``coded`` False) or as its layout's codes (True);
    ``rows`` unchanged."""
    if not rows.tail.length:
        return {}
    raw, have = rows.tail.live_arrays(), rows.tail.coder
    if (have is not None) == coded:
        return raw
    if not coded:
        return have.decode(raw, {n: rows.tail.dtype(n) for n in "kv"})
    coder = rows.tail_coder.bound(rows.k_codec) if rows.tail_coder.centred else rows.tail_coder
    return coder.encode(raw)


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
        _tail_kind(rows, arrays["tail"])
        rows.tail.load_raw({f: mx.array(a) for f, a in arrays["tail"].items()})
        if rows.tail.coder is None:
            rows.tail.dtypes = {n: a.dtype for n, a in arrays["tail"].items()}
        rows.tail_n = [rows.tail.length] * B
    for store, name in ((rows.k_codes, "k_codes"), (rows.v_codes, "v_codes")):
        if arrays[name]:
            store.arrays = dict(arrays[name])
    rows.coded = [rows.k_codes.capacity] * B
    if arrays["k_fit"] or arrays["v_fit"] or not (rows.base[0].blank_fitted(1) or rows.base[1].blank_fitted(1)):
        for which, name in ((0, "k_fit"), (1, "v_fit")):
            fit = arrays[name]
            if B > 1 and fit and next(iter(fit.values())).shape[0] == H:  # one fit shared by every sequence
                fit = {n: mx.concatenate([a] * B, axis=0) for n, a in fit.items()}
            codec = rows.base[which].with_fitted(fit)
            rows.k_codec, rows.v_codec = (codec, rows.v_codec) if which == 0 else (rows.k_codec, codec)
        rows.fitted = [True] * B
    rows.sync_tail()
    return rows


def _tail_kind(rows: Rows, arrays: Dict[str, mx.array]) -> None:
    """Hold the tail ``arrays`` are of (checked by the saved state): exact ``{"k", "v"}``, else the layout's codes
    (`Rows.sync_tail` then makes it the kind the rows' counts call for)."""
    rows.tail.coder = None if set(arrays) == {"k", "v"} or rows.tail_coder is None else rows.tail_coder


def batch_rows_from_arrays(options, window, dims, heads: int, arrays: Dict[str, Dict[str, mx.array]],
                           counts: Dict[str, List]) -> Rows:
    """The `Rows` of a batch's arrays as it stores them (already checked against ``options``, ``dims`` and
    ``counts``): ``sink`` (every slot), ``tail`` (right-aligned), ``k_codes`` / ``v_codes`` (their slots),
    ``k_fit`` / ``v_fit`` (``(B*H, ...)``), each ``{}`` when empty; ``counts``: each row's `COUNTS` and ``fitted``."""
    rows = Rows(options, len(counts["lengths"]), window)
    rows.setup(*dims, heads)
    if arrays["sink"]:
        rows.sink = dict(arrays["sink"])
        rows.tail.dtypes = {n: a.dtype for n, a in arrays["sink"].items()}
    if arrays["tail"]:
        _tail_kind(rows, arrays["tail"])
        rows.tail.load_raw(dict(arrays["tail"]))
        if rows.tail.coder is None:
            rows.tail.dtypes = {n: a.dtype for n, a in arrays["tail"].items()}
    for store, name in ((rows.k_codes, "k_codes"), (rows.v_codes, "v_codes")):
        store.arrays = dict(arrays[name])  # (its slots)
    rows.k_codec = rows.base[0].with_fitted(arrays["k_fit"])
    rows.v_codec = rows.base[1].with_fitted(arrays["v_fit"])
    for name in COUNTS + ("fitted",):
        setattr(rows, name, list(counts[name]))
    rows.sync_tail()
    return rows
