"""Saved states of every packed cache kind, in one module: the arrays' names, writing a ``state``, and the checked
restore behind every ``from_state`` (the faces' ``state`` / ``from_state`` only call in here).

A state is a dict: a JSON ``meta`` string plus the live arrays, each named ``<prefix><field>``: the prefix says
which part of the rows holds it, the field is the codec's (or ``k`` / ``v`` of an exact window). Two schemes,
both on disk in prompt-cache files of earlier versions, so never renamed (`single_prefixes`, `batch_prefixes`
build every name; `_write` writes them, `_take` reads them back):

=========  ================================================  ============================================
part       single (TurboQuantPackedCache and its rotating     batch (TurboQuantBatch(Rotating)PackedCache,
           face; ``meta`` format 3, formats 1 and 2 read)     ``meta`` format 1, each row's counts)
=========  ================================================  ============================================
sink       ``s_``                                             ``s_`` (every slot, ``options.sink``)
tail       ``t_`` (exact ``k``/``v``, or the coder's fields)  ``t_`` (right-aligned, as stored)
k_codes    ``c_k_`` per-token codes, ``kc_`` block codes      ``ck_`` (the store's slots)
v_codes    ``c_v_``                                           ``cv_``
k_fit      ``kfit_`` (fitted key parameters, ``(H, ...)``)    ``kfit_`` (``(B*H, ...)``)
v_fit      ``vfit_``                                          ``vfit_``
=========  ================================================  ============================================

Restoring believes nothing the arrays cannot confirm: `read_meta` / `read_batch_meta` parse and check the JSON
``meta`` (options, offset, dims, token counts); `restore_rows` / `restore_batch_rows` check every array against
what the options and dims imply (each codec's ``check_codes`` / ``load_fitted``, the exact windows' shapes, the
token counts and the offset) and only then build the `Rows` through their public constructors
(`rows_from_arrays`, `batch_rows_from_arrays`). Errors are ValueErrors naming the array or field, so a
prompt-cache file that does not add up is refused when it is loaded, not at first use.

The seed's `TurboQuantRVQKVCache` (:mod:`veloxquant_mlx.compat.turboquant_rvq_cache`) has no names: its state
is the tuple of its four arrays and ``meta_state`` four strings; its checks stay with it (compat is below
nothing in cache/ and imports none of it) and :mod:`veloxquant_mlx.cache.prompt_cache_io` keeps its
``meta_state`` in a file's metadata.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Tuple

import mlx.core as mx

from veloxquant_mlx.cache._face import _check_window
from veloxquant_mlx.cache.row_policy import Rows
from veloxquant_mlx.cache.row_codes import TailCoder
from veloxquant_mlx.cache.row_ops import batch_rows_from_arrays, row_arrays, rows_from_arrays
from veloxquant_mlx.codecs import codec_layout
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.validate import FLOAT_DTYPES

# of a single cache's ``state``; formats 1 (config + options) and 2 are still read, except turboquant_prod codes:
# format 3 changed their QJL sketch (orthogonal rows), so older prod codes would decode wrongly
FORMAT = 4
BATCH_FORMAT = 2  # of a batch cache's ``state``
_FORMATS, _BATCH_FORMATS = (1, 2, 3, 4), (1, 2)  # what `read_meta` / `read_batch_meta` read
# The formats before which a coded tail's provisional keys took the block keys' rotation even where that was
# "none" (now: a mixing rotation, `TailedBlockKeyCodec.tail_codec`): such states cannot be decoded today.
_TAIL_ROTATION_FORMAT, _BATCH_TAIL_ROTATION_FORMAT = 4, 2
_CACHE_KEYS = ("fetch_placeholders", "max_size", "keep")  # format 1: the constructor's arguments among the options
BATCH_ROWS = ("lengths", "sink_n", "coded", "tail_n")  # per-row token counts in a batch state's meta (+ "start")

# -- names -----------------------------------------------------------------------------------------------------
PARTS = ("sink", "tail", "k_codes", "v_codes", "k_fit", "v_fit")  # what `row_arrays` gives, in the state's order


def single_prefixes(block: int) -> Dict[str, str]:
    """Part -> array name prefix of a single cache's state (format-1 names: per-token key codes "c_k_*", the
    transposed keys of a codec coding blocks of ``block`` > 1 tokens "kc_*")."""
    return dict(zip(PARTS, ("s_", "t_", "kc_" if block > 1 else "c_k_", "c_v_", "kfit_", "vfit_")))


def batch_prefixes() -> Dict[str, str]:
    """Part -> array name prefix of a batch cache's state."""
    return dict(zip(PARTS, ("s_", "t_", "ck_", "cv_", "kfit_", "vfit_")))


def _write(meta: Dict[str, Any], prefixes: Dict[str, str], arrays: Dict[str, Dict[str, mx.array]]) -> Dict[str, Any]:
    """The state: ``meta`` as JSON, then every part's arrays under its prefix (``arrays``: part -> field -> array)."""
    out: Dict[str, Any] = {"meta": json.dumps(meta, sort_keys=True)}
    for part, prefix in prefixes.items():
        out.update({prefix + f: a for f, a in arrays.get(part, {}).items()})
    return out


def _take(cls, state: Dict[str, Any], prefix: str) -> Dict[str, mx.array]:
    """The arrays of ``state`` named ``prefix*``, by field (each an mx.array, or ValueError naming it)."""
    out = {n[len(prefix):]: a for n, a in state.items() if n.startswith(prefix)}
    for n, a in out.items():
        if not isinstance(a, mx.array):
            raise _fail(cls, f"{prefix}{n} must be an mx.array, got {type(a).__name__}")
    return out


# -- writing ---------------------------------------------------------------------------------------------------
def single_state(cache) -> Dict[str, Any]:
    """A single cache's ``state``: its live arrays (sequences in lockstep concatenated) and a JSON ``meta``."""
    r = cache.rows
    meta = {"format": FORMAT, "class": type(cache).__name__, "options": cache.options.to_dict(),
            "cache": cache._cache_meta(), "offset": cache.offset, "dims": list(r.dims) if r.dims else None,
            "stores": {"codes": cache.n_coded, "sink": r.sink_n[0], "tail": r.tail_n[0]}}
    per_row = [row_arrays(r, i) for i in range(r.B)]
    arrays = per_row[0] if r.B == 1 else {  # sequences in lockstep: their arrays share every shape
        name: {f: mx.concatenate([p[name][f] for p in per_row], axis=0) for f in per_row[0][name]}
        for name in per_row[0]}
    return _write(meta, single_prefixes(r.block), arrays)


def batch_state(batch) -> Dict[str, Any]:
    """A batch cache's ``state``: every array held, as stored (no copies: mlx_lm evaluates this between steps),
    and a JSON ``meta`` with the options and each row's token counts."""
    r = batch.rows
    meta = {"format": BATCH_FORMAT, "class": type(batch).__name__, "options": batch.options.to_dict(),
            "cache": batch._cache_meta(), "dims": list(r.dims) if r.dims else None, "heads": r.heads,
            "rows": {**{n: list(getattr(r, n)) for n in BATCH_ROWS}, "start": list(r.gone),
                     "fitted": list(r.fitted)},
            "mid_prompt": batch._pending is not None or batch._lead is not None}
    if r.dims is None:
        return _write(meta, batch_prefixes(), {})
    arrays = {"sink": r.sink or {}, "tail": r.tail.live_arrays() if r.tail.length else {},
              "k_codes": r.k_codes.arrays, "v_codes": r.v_codes.arrays,
              "k_fit": r.fitted_rows(0), "v_fit": r.fitted_rows(1)}
    return _write(meta, batch_prefixes(), arrays)


# -- restoring -------------------------------------------------------------------------------------------------
def restore_single(cls, state):
    """``cls.from_state(state)`` of a single cache class: refuses, naming the array, a state whose arrays do not
    match its options, dims and token counts."""
    options, kwargs, meta = read_meta(cls, state)
    cache = cls(options, **kwargs)
    cache.rows = restore_rows(cls, state, meta, options, cache.window)
    return cache


def restore_batch(cls, state):
    """``cls.from_state(state)`` of a batch cache class: its arrays checked against the meta, then each row read
    out as the per-sequence cache `extract` gives and checked by ``cls._single.from_state`` (a batch believes no
    more than a sequence alone)."""
    options, kwargs, meta = read_batch_meta(cls, state)
    window = (kwargs.pop("max_size"), kwargs.pop("keep")) if "max_size" in kwargs else None
    if window is not None:
        window = _check_window(options, *window)
    batch = cls(options, len(meta["rows"]["lengths"]), window=window, **kwargs)
    batch.rows = restore_batch_rows(cls, state, meta, batch.rows)
    if batch.rows.dims is not None and batch.B:
        for i in range(batch.B):
            try:
                cls._single.from_state(batch.extract(i).state)
            except ValueError as e:
                raise ValueError(f"{cls.__name__} state: row {i}: {e}") from None
    batch._set_offset()
    return batch


def _fail(cls, what: str):
    return ValueError(f"{cls.__name__} state: {what}")


def _parse_meta(cls, state, formats) -> Dict[str, Any]:
    """``state["meta"]`` parsed, of a known format and written by ``cls``."""
    if not isinstance(state, dict) or not isinstance(state.get("meta"), str):
        raise ValueError(f"{cls.__name__}.from_state expects the dict written by .state (with a 'meta' string), "
                         f"got {type(state).__name__}")
    try:
        meta = json.loads(state["meta"])
    except (json.JSONDecodeError, RecursionError) as e:
        raise _fail(cls, f"'meta' is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in formats:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise _fail(cls, f"unsupported format {got!r} (expected one of {formats})")
    if meta.get("class") != cls.__name__:
        raise _fail(cls, f"it was written by {meta.get('class')!r}, not {cls.__name__!r}")
    return meta


def read_meta(cls, state) -> Tuple[Any, Dict[str, Any], Dict[str, Any]]:
    """``(CacheOptions, constructor keyword arguments, meta dict)`` from ``state["meta"]``."""
    meta = _parse_meta(cls, state, _FORMATS)
    try:
        if meta["format"] == 1:  # options split into a KVCacheConfig dict and cache options
            opts = dict(meta["options"])
            kwargs = {k: opts.pop(k) for k in _CACHE_KEYS if k in opts}
            options = CacheOptions.from_kv_config(KVCacheConfig.from_dict(meta["config"]), **opts)
        else:
            options = CacheOptions.from_dict(meta["options"])
            kwargs = dict(meta["cache"])
        offset, dims, stores = meta["offset"], meta["dims"], meta["stores"]
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(cls, f"'meta' does not hold valid options ({e})") from None
    if meta["format"] < 3 and options.method == "turboquant_prod" and options.codec == "lloyd_max":
        raise _fail(cls, f"turboquant_prod codes of format {meta['format']} were sketched with the Gaussian QJL "
                         "matrix this version replaced (format 3); they cannot be read: build the cache again")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise _fail(cls, f"'meta' offset must be an int >= 0, got {offset!r}")
    if dims is not None and not (isinstance(dims, list) and len(dims) == 2
                                 and all(isinstance(d, int) and d > 0 for d in dims)):
        raise _fail(cls, f"'meta' dims must be None or two positive ints, got {dims!r}")
    if not (isinstance(stores, dict) and set(stores) == {"codes", "sink", "tail"}
            and all(isinstance(v, int) and v >= 0 for v in stores.values())):
        raise _fail(cls, f"'meta' stores must give the token counts of codes, sink and tail, got {stores!r}")
    return options, kwargs, meta


def _check_exact(cls, name: str, arrays: Dict[str, mx.array], dims) -> None:
    if set(arrays) != {"k", "v"}:
        raise _fail(cls, f"the {name} window must hold arrays 'k' and 'v', got {sorted(arrays)}")
    for field, d in zip(("k", "v"), dims):
        a = arrays[field]
        if a.ndim != 4 or a.shape[-1] != d or a.dtype not in FLOAT_DTYPES:
            raise _fail(cls, f"array of the {name} window {field!r} has shape {tuple(a.shape)} {a.dtype}, "
                             f"expected (B, H, n, {d}) floats")
    if arrays["k"].shape[:3] != arrays["v"].shape[:3]:
        raise _fail(cls, f"the {name} window's 'k' and 'v' disagree on (B, H, n)")


def _check_tail(cls, arrays: Dict[str, mx.array], dims, coder, codec: str, prefix: str, coded: bool = True) -> int:
    """The tail's arrays (``prefix*``) as this layout stores them (exact ``k`` / ``v``, or ``coder``'s fields); its
    token count. ``coded``: whether the rows hold coded blocks; before the first (`Rows.sync_tail`), a layout with a
    coder holds its tail exact, and a state saved coded then (by an earlier version) is read too."""
    if coder is not None and not coded and set(arrays) == {"k", "v"}:
        coder = None
    if coder is None:
        _check_exact(cls, "tail", arrays, dims)
        return arrays["k"].shape[2]
    fields = coder.fields(dims)
    if set(arrays) != set(fields):
        old = " (an exact tail: saved by a version that held waiting tokens exact, or of another layout)" \
            if set(arrays) == {"k", "v"} else ""
        raise _fail(cls, f"codec={codec!r} stores the tokens waiting for their key block as codes "
                         f"{sorted(prefix + f for f in fields)}, got tail arrays "
                         f"{sorted(prefix + f for f in arrays)}{old}")
    lead = {tuple(a.shape[:3]) for a in arrays.values()}
    if len(lead) != 1:
        raise _fail(cls, f"the tail's code arrays disagree on (B, H, n): {sorted(lead)}")
    for f, (trailing, dtype) in fields.items():
        a = arrays[f]
        if a.ndim != 3 + len(trailing) or tuple(a.shape[3:]) != tuple(trailing) or a.dtype != dtype:
            raise _fail(cls, f"tail array {prefix}{f} has shape {tuple(a.shape)} {a.dtype}, expected (B, H, n, "
                             f"{', '.join(map(str, trailing))}) {dtype}")
    return lead.pop()[2]


def _check_tail_rotation(cls, tail: Dict[str, mx.array], key_codec, old_format: bool) -> None:
    """Refuse a coded tail that an earlier version wrote with unrotated provisional keys (block keys coded in the
    model's own channels): today's codec reads them under a mixing rotation, so they would decode wrong."""
    if old_format and tail and set(tail) != {"k", "v"} and getattr(key_codec, "rotation_kind", None) == "none":
        raise _fail(cls, "its coded tail (arrays " + ", ".join(sorted(tail)) + ") was written by an earlier version "
                         "that coded waiting keys unrotated where the block keys are (key_rotation='none'); this "
                         "version codes them under a mixing rotation and cannot read them: build the cache again")


def restore_rows(cls, state: Dict[str, Any], meta: Dict[str, Any], options, window):
    """The `Rows` a single cache's ``state`` describes, every array checked against ``options`` and ``meta``."""
    names = set(state) - {"meta"}
    if meta["dims"] is None:
        if names or meta["offset"]:
            raise _fail(cls, f"no head dims recorded, yet it holds arrays {sorted(names)} / offset {meta['offset']}")
        return rows_from_arrays(options, window, None, {}, meta["offset"])
    dims = tuple(meta["dims"])
    if options.head_dim is not None and options.head_dim != dims[0]:
        raise _fail(cls, f"'meta' dims {list(dims)} disagree with head_dim={options.head_dim}")
    codecs = codec_layout(options.codec).make(options, *dims)
    prefixes = single_prefixes(codecs[0].token_block)
    loaded = {p: _take(cls, state, p) for p in prefixes.values()}
    unexpected = sorted(names - {p + n for p, arrays in loaded.items() for n in arrays})
    if unexpected:
        raise _fail(cls, f"unexpected arrays {unexpected}")
    s_, t_, kc_, cv_, kfit_, vfit_ = (prefixes[p] for p in PARTS)
    counts = {}
    if loaded[s_]:
        _check_exact(cls, "sink", loaded[s_], dims)
    counts[s_] = loaded[s_]["k"].shape[2] if loaded[s_] else 0
    coder = None if window else TailCoder.for_codecs(options, codecs)
    counts[t_] = _check_tail(cls, loaded[t_], dims, coder, options.codec, t_,
                             bool(meta["stores"]["codes"])) if loaded[t_] else 0
    _check_tail_rotation(cls, loaded[t_], codecs[0], meta["format"] < _TAIL_ROTATION_FORMAT)
    for prefix, codec in ((kc_, codecs[0]), (cv_, codecs[1])):
        if loaded[prefix]:
            try:
                codec.check_codes(loaded[prefix], f"{prefix}*")
            except ValueError as e:
                raise _fail(cls, str(e)) from None
        counts[prefix] = codec.n_tokens(loaded[prefix]) if loaded[prefix] else 0
    rows = {a.shape[0] * a.shape[1] for p in (s_, t_, kc_, cv_) for a in loaded[p].values() if a.ndim >= 2}
    for prefix, codec in ((kfit_, codecs[0]), (vfit_, codecs[1])):
        try:
            codec.load_fitted(loaded[prefix]) if loaded[prefix] else None  # (a copy made by make(): checks only)
        except ValueError as e:
            raise _fail(cls, f"{prefix}*: {e}") from None
        for n, a in loaded[prefix].items():  # one row per (sequence, head) the stores hold
            if len(rows) == 1 and a.shape[0] not in rows:
                raise _fail(cls, f"fitted array {prefix}{n} has {a.shape[0]} rows, but the stores hold "
                                 f"{rows.pop()} (sequence, head) rows")
    stores = meta["stores"]
    expected = {s_: stores["sink"], t_: stores["tail"], kc_: stores["codes"], cv_: stores["codes"]}
    for prefix, n in counts.items():
        if n != expected[prefix]:
            raise _fail(cls, f"arrays {prefix}* hold {n} tokens, but 'meta' says {expected[prefix]}")
    heads = {tuple(a.shape[:2]) for p in (s_, t_, kc_, cv_) for a in loaded[p].values()}
    if len(heads) > 1:
        raise _fail(cls, f"stored arrays disagree on (B, H): {sorted(heads)}")
    stored = stores["sink"] + stores["tail"] + stores["codes"]
    if (stored != meta["offset"]) if window is None else (stored > meta["offset"]):
        raise _fail(cls, f"offset {meta['offset']} does not match the {stored} tokens stored")
    for prefix, codec in ((kfit_, codecs[0]), (vfit_, codecs[1])):
        if stores["codes"] and codec.blank_fitted(1) and not loaded[prefix]:
            # codes read only with the parameters they were coded with
            raise _fail(cls, f"{stores['codes']} coded tokens but no fitted codec arrays ({prefix}*)")
    if stores["sink"] != min(options.sink, meta["offset"]):
        raise _fail(cls, f"the sink holds {stores['sink']} tokens, expected min(sink={options.sink}, offset)")
    arrays = {part: loaded[prefix] for part, prefix in prefixes.items()}
    try:
        return rows_from_arrays(options, window, dims, arrays, meta["offset"])
    except ValueError as e:
        raise _fail(cls, str(e)) from None


# -- batch caches ------------------------------------------------------------------------------------------
def _count_list(cls, name: str, value, B: int) -> None:
    if not (isinstance(value, list) and len(value) == B
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise _fail(cls, f"'meta' rows[{name!r}] must be {B} ints >= 0, got {value!r}")


def read_batch_meta(cls, state) -> Tuple[Any, Dict[str, Any], Dict[str, Any]]:
    """``(CacheOptions, constructor keyword arguments, meta dict)`` of a batch cache's ``state["meta"]``."""
    meta = _parse_meta(cls, state, _BATCH_FORMATS)
    try:
        options = CacheOptions.from_dict(meta["options"])
        kwargs, dims, heads, rows = dict(meta["cache"]), meta["dims"], meta["heads"], meta["rows"]
        mid_prompt = meta["mid_prompt"]
    except (KeyError, TypeError, ValueError) as e:
        raise _fail(cls, f"'meta' does not hold valid options ({e})") from None
    if mid_prompt is not False:
        raise _fail(cls, "it was saved in the middle of a prompt (between prepare and finalize); save it after "
                         "finalize")
    if dims is not None and not (isinstance(dims, list) and len(dims) == 2
                                 and all(isinstance(d, int) and d > 0 for d in dims)):
        raise _fail(cls, f"'meta' dims must be None or two positive ints, got {dims!r}")
    if not isinstance(heads, int) or heads < 0 or (dims is not None) != (heads > 0):
        raise _fail(cls, f"'meta' heads must be a positive int when dims are recorded (0 before), got {heads!r}")
    want = set(BATCH_ROWS) | {"start", "fitted"}
    if not isinstance(rows, dict) or set(rows) != want:
        raise _fail(cls, f"'meta' rows must hold {sorted(want)}, got {rows!r}")
    B = len(rows["lengths"]) if isinstance(rows["lengths"], list) else -1
    for name in BATCH_ROWS + ("start",):
        _count_list(cls, name, rows[name], B)
    if not (isinstance(rows["fitted"], list) and len(rows["fitted"]) == B
            and all(isinstance(f, bool) for f in rows["fitted"])):
        raise _fail(cls, f"'meta' rows['fitted'] must be {B} booleans, got {rows['fitted']!r}")
    return options, kwargs, meta


def restore_batch_rows(cls, state: Dict[str, Any], meta: Dict[str, Any], batch: Rows) -> Rows:
    """The `Rows` a batch ``state`` describes: its arrays checked against its meta (shapes, dtypes, row counts
    within the stored slots) and the layouts of ``batch`` (the empty `Rows` of the meta's options and rows, set up
    here to read them: a template, not filled), then built by `batch_rows_from_arrays`."""
    rows, B = meta["rows"], batch.B
    names = set(state) - {"meta"}
    if meta["dims"] is None:
        if names or any(rows["lengths"]):
            raise _fail(cls, f"no head dims recorded, yet it holds arrays {sorted(names)} / lengths {rows['lengths']}")
        return batch
    options, window = batch.options, batch.window  # (as the constructor gave them: `setup` refines the options)
    batch.setup(*meta["dims"], meta["heads"])
    H = batch.heads
    prefixes = batch_prefixes()
    claimed = set()

    def take(part: str) -> Dict[str, mx.array]:
        arrays = _take(cls, state, prefixes[part])
        claimed.update(prefixes[part] + n for n in arrays)
        return arrays

    sink, S = take("sink"), 0
    if sink:
        _check_exact(cls, "sink", sink, batch.dims)
        S = sink["k"].shape[2]
        if sink["k"].shape[:2] != (B, H):
            raise _fail(cls, f"the sink window's arrays must hold (B, H) = ({B}, {H}), got "
                             f"{tuple(sink['k'].shape[:2])}")
        if S != batch.options.sink:
            raise _fail(cls, f"the sink arrays hold {S} slots, expected sink={batch.options.sink}")
    tail = take("tail")
    L = _check_tail(cls, tail, batch.dims, batch.tail_coder, batch.options.codec, prefixes["tail"],
                    any(rows["coded"])) if tail else 0
    _check_tail_rotation(cls, tail, batch.base[0], meta["format"] < _BATCH_TAIL_ROTATION_FORMAT)
    if tail and tail[next(iter(tail))].shape[:2] != (B, H):
        raise _fail(cls, f"the tail window's arrays must hold (B, H) = ({B}, {H}), got "
                         f"{tuple(tail[next(iter(tail))].shape[:2])}")
    capacity = None
    codes = {}
    for part, store in (("k_codes", batch.k_codes), ("v_codes", batch.v_codes)):
        prefix, arrays = prefixes[part], take(part)
        codes[part] = arrays
        cap = 0 if not arrays else _check_codes(cls, prefix, arrays, store, B)
        if capacity not in (None, cap):
            raise _fail(cls, f"key and value codes hold {capacity} and {cap} token slots")
        capacity = cap
    fits = {}
    for which, part in enumerate(("k_fit", "v_fit")):
        prefix, arrays = prefixes[part], take(part)
        fits[part] = arrays
        placeholder = batch.fitted_rows(which)
        if set(arrays) != set(placeholder):
            raise _fail(cls, f"fitted arrays {prefix}* must be {sorted(placeholder)}, got {sorted(arrays)}")
        for n, a in arrays.items():
            if tuple(a.shape) != tuple(placeholder[n].shape) or a.dtype != placeholder[n].dtype:
                raise _fail(cls, f"fitted array {prefix}{n} has shape {tuple(a.shape)} {a.dtype}, expected "
                                 f"{tuple(placeholder[n].shape)} {placeholder[n].dtype} (B*H rows)")
        try:
            batch.base[which].with_fitted(arrays)  # (checks only: the rows are built below)
        except ValueError as e:
            raise _fail(cls, f"{prefix}*: {e}") from None
    unexpected = sorted(names - claimed)
    if unexpected:
        raise _fail(cls, f"unexpected arrays {unexpected}")
    for i in range(B):
        if rows["sink_n"][i] > S or rows["tail_n"][i] > L or not rows["start"][i] <= rows["coded"][i] <= capacity:
            raise _fail(cls, f"row {i}'s counts (sink {rows['sink_n'][i]}, codes {rows['start'][i]}.."
                             f"{rows['coded'][i]}, tail {rows['tail_n'][i]}) exceed the stored slots (sink {S}, "
                             f"codes {capacity}, tail {L})")
    counts = {**{n: rows[n] for n in BATCH_ROWS}, "gone": rows["start"], "fitted": rows["fitted"]}
    arrays = {"sink": sink, "tail": tail, **codes, **fits}
    return batch_rows_from_arrays(options, window, batch.dims, H, arrays, counts)


def _check_codes(cls, prefix: str, arrays: Dict[str, mx.array], store, B: int) -> int:
    """A batch's code arrays ``prefix*`` against ``store``'s layout (B rows, whole units of slots); their token
    slots."""
    if set(arrays) != set(store.layout):
        raise _fail(cls, f"arrays {prefix}* must be {sorted(store.layout)}, got {sorted(arrays)}")
    cap = None
    for f, (axis, units, shape, dtype) in store.layout.items():
        a = arrays[f]
        n = a.shape[axis] if a.ndim == len(shape) else -1
        want = (B,) + tuple(shape[1:axis]) + (n,) + tuple(shape[axis + 1:])
        if a.ndim != len(shape) or tuple(a.shape) != want or a.dtype != dtype or n % units:
            raise _fail(cls, f"array {prefix}{f} has shape {tuple(a.shape)} {a.dtype}, expected {want} "
                             f"{dtype} with a multiple of {units} on axis {axis}")
        tokens = n // units * store.block
        if cap not in (None, tokens):
            raise _fail(cls, f"arrays {prefix}* disagree on their token slots")
        cap = tokens
    return cap
