"""Reading a packed cache's saved ``state`` back: believe nothing the arrays cannot confirm.

`read_meta` parses and checks the JSON ``meta`` (options, offset, dims, token counts); `restore_arrays` checks
every array against what the options and dims imply (each codec's ``check_codes`` / ``load_fitted``, the exact
windows' shapes, the token counts and the offset) before the cache holds it. Errors are ValueErrors naming the
array or field, so a prompt-cache file that does not add up is refused when it is loaded, not at first use.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Tuple

import mlx.core as mx

from veloxquant_mlx.cache.rows import Rows, TailCoder, rows_from_arrays
from veloxquant_mlx.codecs import codec_layout
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.options import CacheOptions
from veloxquant_mlx.validate import FLOAT_DTYPES

_FORMATS = (1, 2, 3)
_CACHE_KEYS = ("fetch_placeholders", "max_size", "keep")


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
    if not isinstance(meta, dict) or meta.get("format") not in _FORMATS:
        got = meta.get("format") if isinstance(meta, dict) else meta
        raise _fail(cls, f"unsupported format {got!r} (expected one of {_FORMATS})")
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


def _check_tail(cls, arrays: Dict[str, mx.array], dims, coder, codec: str) -> int:
    """The tail's arrays as this layout stores them (exact ``k`` / ``v``, or ``coder``'s fields); its token count."""
    if coder is None:
        _check_exact(cls, "tail", arrays, dims)
        return arrays["k"].shape[2]
    fields = coder.fields(dims)
    if set(arrays) != set(fields):
        old = " (an exact tail: saved by a version that held waiting tokens exact, or of another layout)" \
            if set(arrays) == {"k", "v"} else ""
        raise _fail(cls, f"codec={codec!r} stores the tokens waiting for their key block as codes "
                         f"{sorted('t_' + f for f in fields)}, got tail arrays {sorted('t_' + f for f in arrays)}{old}")
    lead = {tuple(a.shape[:3]) for a in arrays.values()}
    if len(lead) != 1:
        raise _fail(cls, f"the tail's code arrays disagree on (B, H, n): {sorted(lead)}")
    for f, (trailing, dtype) in fields.items():
        a = arrays[f]
        if a.ndim != 3 + len(trailing) or tuple(a.shape[3:]) != tuple(trailing) or a.dtype != dtype:
            raise _fail(cls, f"tail array t_{f} has shape {tuple(a.shape)} {a.dtype}, expected (B, H, n, "
                             f"{', '.join(map(str, trailing))}) {dtype}")
    return lead.pop()[2]


def single_prefixes(block: int) -> tuple:
    """Array name prefixes of a single cache's state: sink, tail, key codes, value codes, fitted key / value
    parameters (format-1 names: per-token key codes "c_k_*", transposed block keys "kc_*")."""
    return ("s_", "t_", "kc_" if block > 1 else "c_k_", "c_v_", "kfit_", "vfit_")


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
    loaded = {p: _take(cls, state, p) for p in prefixes}
    unexpected = sorted(names - {p + n for p, arrays in loaded.items() for n in arrays})
    if unexpected:
        raise _fail(cls, f"unexpected arrays {unexpected}")
    s_, t_, kc_, cv_, kfit_, vfit_ = prefixes
    counts = {}
    if loaded[s_]:
        _check_exact(cls, "sink", loaded[s_], dims)
    counts[s_] = loaded[s_]["k"].shape[2] if loaded[s_] else 0
    coder = None if window else TailCoder.for_codecs(options, codecs)
    counts[t_] = _check_tail(cls, loaded[t_], dims, coder, options.codec) if loaded[t_] else 0
    for prefix, codec in ((kc_, codecs[0]), (cv_, codecs[1])):
        if loaded[prefix]:
            try:
                codec.check_codes(loaded[prefix], f"{prefix}*")
            except ValueError as e:
                raise _fail(cls, str(e)) from None
        counts[prefix] = codec.n_tokens(loaded[prefix]) if loaded[prefix] else 0
    for prefix, codec in ((kfit_, codecs[0]), (vfit_, codecs[1])):
        try:
            codec.load_fitted(loaded[prefix]) if loaded[prefix] else None  # (a copy made by make(): checks only)
        except ValueError as e:
            raise _fail(cls, f"{prefix}*: {e}") from None
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
    arrays = {"sink": loaded[s_], "tail": loaded[t_], "k_codes": loaded[kc_], "v_codes": loaded[cv_],
              "k_fit": loaded[kfit_], "v_fit": loaded[vfit_]}
    try:
        return rows_from_arrays(options, window, dims, arrays, meta["offset"])
    except ValueError as e:
        raise _fail(cls, str(e)) from None


# -- batch caches ------------------------------------------------------------------------------------------
_BATCH_FORMATS = (1,)
BATCH_ROWS = ("lengths", "sink_n", "coded", "tail_n")  # per-row token counts in a batch state's meta (+ "start")


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


def _take(cls, state: Dict[str, Any], prefix: str) -> Dict[str, mx.array]:
    out = {n[len(prefix):]: a for n, a in state.items() if n.startswith(prefix)}
    for n, a in out.items():
        if not isinstance(a, mx.array):
            raise _fail(cls, f"{prefix}{n} must be an mx.array, got {type(a).__name__}")
    return out


def restore_batch_rows(cls, state: Dict[str, Any], meta: Dict[str, Any], batch: Rows) -> Rows:
    """Check a batch ``state``'s arrays against its meta (shapes, dtypes, row counts within the stored slots) and
    load them into ``batch`` (the empty `Rows` of the meta's options and rows), so that every row can be read."""
    rows, B = meta["rows"], batch.B
    names = set(state) - {"meta"}
    if meta["dims"] is None:
        if names or any(rows["lengths"]):
            raise _fail(cls, f"no head dims recorded, yet it holds arrays {sorted(names)} / lengths {rows['lengths']}")
        return batch
    batch.setup(*meta["dims"], meta["heads"])
    H = batch.heads
    claimed = set()

    def exact(prefix: str, what: str):
        arrays = _take(cls, state, prefix)
        claimed.update(prefix + n for n in arrays)
        if not arrays:
            return None, 0
        _check_exact(cls, what, arrays, batch.dims)
        if arrays["k"].shape[:2] != (B, H):
            raise _fail(cls, f"the {what} window's arrays must hold (B, H) = ({B}, {H}), got "
                             f"{tuple(arrays['k'].shape[:2])}")
        return arrays, arrays["k"].shape[2]

    sink, S = exact("s_", "sink")
    if sink is not None and S != batch.options.sink:
        raise _fail(cls, f"the sink arrays hold {S} slots, expected sink={batch.options.sink}")
    tail = _take(cls, state, "t_")
    claimed.update("t_" + n for n in tail)
    L = _check_tail(cls, tail, batch.dims, batch.tail.coder, batch.options.codec) if tail else 0
    if tail and tail[next(iter(tail))].shape[:2] != (B, H):
        raise _fail(cls, f"the tail window's arrays must hold (B, H) = ({B}, {H}), got "
                         f"{tuple(tail[next(iter(tail))].shape[:2])}")
    tail = tail or None
    capacity = None
    for prefix, store in (("ck_", batch.k_codes), ("cv_", batch.v_codes)):
        arrays = _take(cls, state, prefix)
        claimed.update(prefix + n for n in arrays)
        if not arrays:
            cap = 0
        else:
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
        if capacity not in (None, cap):
            raise _fail(cls, f"key and value codes hold {capacity} and {cap} token slots")
        capacity = cap
        store.arrays = arrays  # (cap slots)
    for which, prefix in enumerate(("kfit_", "vfit_")):
        arrays = _take(cls, state, prefix)
        claimed.update(prefix + n for n in arrays)
        placeholder = batch.fitted_rows(which)
        if set(arrays) != set(placeholder):
            raise _fail(cls, f"fitted arrays {prefix}* must be {sorted(placeholder)}, got {sorted(arrays)}")
        for n, a in arrays.items():
            if tuple(a.shape) != tuple(placeholder[n].shape) or a.dtype != placeholder[n].dtype:
                raise _fail(cls, f"fitted array {prefix}{n} has shape {tuple(a.shape)} {a.dtype}, expected "
                                 f"{tuple(placeholder[n].shape)} {placeholder[n].dtype} (B*H rows)")
        try:
            codec = batch.base[which].with_fitted(arrays)
        except ValueError as e:
            raise _fail(cls, f"{prefix}*: {e}") from None
        if which:
            batch.v_codec = codec
        else:
            batch.k_codec = codec
    unexpected = sorted(names - claimed)
    if unexpected:
        raise _fail(cls, f"unexpected arrays {unexpected}")
    for i in range(B):
        if rows["sink_n"][i] > S or rows["tail_n"][i] > L or not rows["start"][i] <= rows["coded"][i] <= capacity:
            raise _fail(cls, f"row {i}'s counts (sink {rows['sink_n'][i]}, codes {rows['start'][i]}.."
                             f"{rows['coded'][i]}, tail {rows['tail_n'][i]}) exceed the stored slots (sink {S}, "
                             f"codes {capacity}, tail {L})")
    batch.sink = sink
    if sink is not None:
        batch.tail.dtypes = {n: a.dtype for n, a in sink.items()}
    if tail is not None:
        batch.tail.load_raw(tail)
        if batch.tail.coder is None:
            batch.tail.dtypes = {n: a.dtype for n, a in tail.items()}
    for name in BATCH_ROWS:
        setattr(batch, name, list(rows[name]))
    batch.gone, batch.fitted = list(rows["start"]), list(rows["fitted"])
    return batch
