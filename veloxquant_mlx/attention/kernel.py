"""The compiled attention on codes (CPU): loading it, what it accepts, and one decode step through it.

`csrc/coded_attention.cpp` is one MLX primitive (``eval_cpu``) that attends one query per row over a history
of codes (`veloxquant_mlx.codecs.contract.AffineCodes`: per-channel block keys, per-token affine or symmetric
values, any bits MLX packs, codebook codes, and a second code stream: TurboQuant-Prod's QJL signs, RVQ's
residual codebook) plus exact tokens, in one pass over the codes with an online softmax, on
every core. The pure-MLX path (`packed_sdpa.attend_one_query`) stays the reference and the fallback: the
kernel is used only when it was built against the MLX that runs (``build_kernel.py``), passed a check against
a direct computation on first use, runs on this CPU (the instruction-set extensions it was compiled for, read
from the module file before the import and asked of the module after it), the default device is the CPU and every
part is of a kind it reads; otherwise attention runs on the reference, with one warning when the reason is that
the kernel is missing, broken or built for another MLX or CPU. ``VELOXQUANT_KERNEL=0`` (or `set_enabled(False)`)
turns it off, for comparisons. The same module holds the affine codecs' encoding (`csrc/affine_encode.cpp`, used
through `veloxquant_mlx.codecs.affine_encode`) and the batch caches' row gather (`csrc/gather_rows.cpp`,
`gather_rows`), under the same switch and first-use check.

The checks a built module must pass (the CPU features it was built for, the first-use computation) are in
:mod:`veloxquant_mlx.attention.kernel_checks`; this module holds the state they decide (the loaded module, why it
is refused, the switch, the call counts) and reads and writes it alone.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import threading
import warnings
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from veloxquant_mlx.attention._sources import source_hash
from veloxquant_mlx.attention.exp2 import LOG2E
from veloxquant_mlx.attention.parts import KeyOffset, coded_keys
from veloxquant_mlx.quant.rope import OFFSET_BLOCK
# The checks on a built module. `_missing_before_import`
# below calls `_binary_flags` / `_cpu_flags` through this module's names, so patching them here takes effect.
from veloxquant_mlx.attention.kernel_checks import (FLAG_FEATURES, _binary_flags, _cpu_flags, _cpu_refusal,
                                                    _smoke_check)
from veloxquant_mlx.codecs.affine_sym_log import LOG_OFFSET, LOG_STEPS, decode_log_scales

_lock = threading.Lock()
_module = None  # the loaded extension, once checked
_reason: Optional[str] = None  # why it is not used (None: not tried yet, or loaded)
_warned = False
_enabled = os.environ.get("VELOXQUANT_KERNEL", "1") not in ("0", "false", "off", "no")

BUILD_HINT = "build it with `python -m veloxquant_mlx.attention.build_kernel` (needs cmake and a C++ compiler)"


def set_enabled(flag: bool) -> bool:
    """Use the compiled kernel when it is available (True, the default) or always the reference; returns the
    previous setting."""
    global _enabled
    if not isinstance(flag, bool):
        raise TypeError(f"flag must be a bool, got {type(flag).__name__}")
    previous, _enabled = _enabled, flag
    return previous


def enabled() -> bool:
    return _enabled


MODULE = "veloxquant_mlx.attention._coded_attention"


def _missing_before_import() -> List[str]:
    """CPU features the module's recorded flags need that this CPU lacks (/proc/cpuinfo), checked before it is
    imported: its static initializers are compiled with those flags too, so even the import could die on an
    illegal instruction. Empty where unknown (no cpuinfo, flags without a known feature: the module's own check
    after the import still runs)."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):  # (ValueError: a stand-in module without a spec, in tests)
        spec = None
    flags = _binary_flags(spec.origin) if spec is not None and spec.origin else None
    cpu = _cpu_flags() if flags else None
    if not cpu:
        return []
    return [FLAG_FEATURES[f] for f in flags if f in FLAG_FEATURES and FLAG_FEATURES[f] not in cpu]


def _load():
    """The checked extension module, or None with `_reason` set."""
    global _module, _reason
    with _lock:
        if _module is not None or _reason is not None:
            return _module
        missing = _missing_before_import()
        if missing:
            _reason = _cpu_refusal(missing)
            return None
        try:
            mod = importlib.import_module(MODULE)
        except ImportError as e:
            _reason = f"the compiled kernel is not built ({e}); {BUILD_HINT}"
            return None
        lacking = getattr(mod, "missing_cpu_features", None)  # (a module built before it existed: not checked)
        missing = list(lacking()) if lacking is not None else []
        if missing:
            _reason = _cpu_refusal(missing)
            return None
        if mod.built_with_mlx != mx.__version__:
            _reason = (f"the compiled kernel was built against MLX {mod.built_with_mlx}, MLX {mx.__version__} is "
                       f"installed; rebuild: {BUILD_HINT}")
            return None
        sources = source_hash()  # (None: an install without the sources; the MLX check above still holds)
        if sources is not None and getattr(mod, "built_from_sources", None) != sources:
            _reason = (f"the compiled kernel was built from other sources than these (built "
                       f"{getattr(mod, 'built_from_sources', 'before sources were recorded')}, sources {sources}: "
                       f"the checkout changed since); rebuild: {BUILD_HINT}")
            return None
        try:
            _smoke_check(mod)
        except Exception as e:  # noqa: BLE001 - any failure means: do not use it
            _reason = f"the compiled kernel failed its first-use check ({type(e).__name__}: {e}); {BUILD_HINT}"
            return None
        _module = mod
        return mod


# Decode / short-chunk attention calls since start: answered by the kernel, and refused by it (then answered by the
# reference; calls the kernel never takes, e.g. with the kernel off or on a GPU, are not counted here).
_calls = {"kernel": 0, "refused": 0}
_refusals: dict = {}  # message -> count; each message warns once


def _refused(error: Exception) -> None:
    _calls["refused"] += 1
    key = re.sub(r"\d+", "#", f"{type(error).__name__}: {error}")  # (one message per kind, whatever the sizes)
    _refusals[key] = _refusals.get(key, 0) + 1
    if _refusals[key] == 1:
        warnings.warn(f"veloxquant_mlx: the compiled kernel refused a call ({key}); that call and those like it run "
                      "on the pure-MLX reference", RuntimeWarning, stacklevel=4)


def calls() -> dict:
    """``{"kernel": n, "refused": n, "refusals": {message: n}}``: decode-step attention calls since start that the
    compiled kernel answered, and those it refused (answered by the pure-MLX reference, one warning per message)."""
    return {**_calls, "refusals": dict(_refusals)}


def status() -> Tuple[bool, str]:
    """``(available, description)``: whether decode steps on affine codes run the compiled kernel, and which path
    runs (printed by the demo and the benchmarks)."""
    if mx.default_device() != mx.cpu:
        return False, f"pure-MLX reference (the compiled kernel is CPU-only; default device {mx.default_device()})"
    if not _enabled:
        return False, "pure-MLX reference (compiled kernel turned off: VELOXQUANT_KERNEL=0 or set_enabled(False))"
    mod = _load()
    if mod is None:
        return False, f"pure-MLX reference ({_reason})"
    flags = getattr(mod, "built_with_flags", "")
    return True, (f"compiled kernel ({mod.threads()} threads, built against MLX {mod.built_with_mlx}"
                  f"{', ' + flags if flags else ''})")


def _usable():
    """The module when this step may use it; warns once when it is missing or broken."""
    global _warned
    if not _enabled or mx.default_device() != mx.cpu:
        return None
    mod = _module if _module is not None else _load()
    if mod is None and not _warned:
        _warned = True
        warnings.warn(f"veloxquant_mlx: attention on codes runs on the pure-MLX reference (slower): {_reason}",
                      RuntimeWarning, stacklevel=3)
    return mod


def compiled_module():
    """The checked extension module when compiled code may run now (enabled, CPU default device, built and
    passed its check), else None; no warning (the attention path warns once when it falls back)."""
    if not _enabled or mx.default_device() != mx.cpu:
        return None
    return _module if _module is not None else _load()


def compiled_encoder():
    """The codecs' compiled affine encoding (`csrc/affine_encode.cpp`) when compiled code may run now, else None
    (a module built before it existed has none). The cache layer hands it to the codecs
    (`veloxquant_mlx.codecs.affine_encode.set_compiled_provider`, in `veloxquant_mlx.cache.row_codes`)."""
    mod = compiled_module()
    return getattr(mod, "affine_encode", None) if mod is not None else None


def compiled_sym_encoder():
    """The codecs' compiled symmetric log-scale encoding (``sym_log_encode``, `csrc/affine_encode.cpp`) when compiled
    code may run now, else None (`veloxquant_mlx.codecs.affine_sym_log.set_compiled_provider`)."""
    mod = compiled_module()
    return getattr(mod, "sym_log_encode", None) if mod is not None else None


def compiled_level_encoder():
    """The codecs' compiled Lloyd-Max log-scale encoding (``level_log_encode``) when compiled code may run now, else
    None (`veloxquant_mlx.codecs.token_lloyd.set_compiled_provider`)."""
    mod = compiled_module()
    return getattr(mod, "level_log_encode", None) if mod is not None else None


def gather_rows(arrays: Sequence[mx.array], rows: Sequence[int], folds: Sequence[int]) -> List[mx.array]:
    """``[mx.take(a, item rows, axis=0)]`` for every array: array i holds items of ``folds[i]`` rows along axis 0
    (a folded ``(B*H, ...)`` array: fold H), and gets items ``rows`` in order, as arrays of their own. One compiled
    operation for all of them where compiled code may run (`csrc/gather_rows.cpp`), else one ``mx.take`` each."""
    fn = getattr(compiled_module(), "gather_rows", None)
    if fn is not None:
        return fn(list(arrays), [int(r) for r in rows], [int(f) for f in folds])
    r = mx.array(list(rows), dtype=mx.int32)
    out = []
    for a, f in zip(arrays, folds):
        idx = r if f == 1 else (r[:, None] * f + mx.arange(f, dtype=mx.int32)[None]).reshape(-1)
        out.append(mx.take(a, idx, axis=0))
    return out


def _reads_log_scales(mod) -> bool:
    """Whether the built module reads uint8 log-grid scales on the grid of `affine_sym_log` (same constants)."""
    return (getattr(mod, "log_scale_offset", None), getattr(mod, "log_scale_steps", None)) == (LOG_OFFSET, LOG_STEPS)


def _readable_scales(codes, mod):
    """``codes`` (AffineCodes or None) with uint8 log-grid scales decoded to float32 when ``mod`` was built
    without that grid (the module reads them itself otherwise)."""
    if codes is None or codes.scales.dtype != mx.uint8 or _reads_log_scales(mod):
        return codes
    return dataclasses.replace(codes, scales=decode_log_scales(codes.scales))


def _row_mask(m: Optional[mx.array], B: int, H: int, n: int) -> Optional[mx.array]:
    """A part's mask (broadcastable to ``(B, H, R, n)``, the same for every query row) -> bool ``(B*H, n)``;
    raises LookupError when it differs across query rows (the reference handles it)."""
    if m is None:
        return None
    shape = (1,) * (4 - m.ndim) + tuple(m.shape)
    if shape[2] != 1 or m.dtype != mx.bool_:
        raise LookupError("per-row or additive mask")
    return mx.contiguous(mx.broadcast_to(m.reshape(shape), (B, H, 1, n)).reshape(B * H, n))


_last_masks = (None, None, None)  # (key, the masks it was made from, (coded mask, exact mask)): `_kernel_masks`


def _kernel_masks(cm, exact, B: int, H: int, n: int):
    """The kernel's bool masks ``(B*H, n)`` of the coded part and ``(B*H, exact tokens)`` of the exact parts (or
    None) from the parts' masks. A batch hands every layer of a decode step the same mask objects: made once
    per step, not once per layer (two to four MLX operations each)."""
    global _last_masks
    given = (cm, *(m for _, m in exact))
    key = (B, H, n, tuple(p.length for p, _ in exact), tuple(map(id, given)))
    last_key, last_given, made = _last_masks
    if last_key == key and all(a is b for a, b in zip(last_given, given)):
        return made
    cmask, emask = _row_mask(cm, B, H, n), None
    if any(m is not None for _, m in exact):
        emask = mx.concatenate([_row_mask(m, B, H, p.length) if m is not None else
                                mx.ones((B * H, p.length), dtype=mx.bool_) for p, m in exact], axis=1)
    _last_masks = (key, given, (cmask, emask))  # (one tuple, replaced whole: other threads see old or new)
    return cmask, emask


def _coded_arguments(coded, mod):
    """``(key codes, value codes, second-stream arguments)`` of a coded part as the kernel reads them, or None when
    it cannot. Kept on the part (with the arrays it was derived from): a cache hands the same part to every
    decode step until it codes its next block, so this runs once per block, not once per layer and step."""
    arrays = (*coded.k_arrays.values(), *coded.v_arrays.values())
    memos = coded.__dict__.setdefault("_kernel_arguments", {})  # per module (benchmarks compare two builds)
    memo = memos.get(id(mod))
    if memo is not None and memo[0] is mod and len(memo[1]) == len(arrays) and \
            all(a is b for a, b in zip(memo[1], arrays)):
        return memo[2]
    result = _derive_coded_arguments(coded, mod)
    if len(memos) > 2:
        memos.clear()
    memos[id(mod)] = (mod, arrays, result)
    return result


def _group_ok(codes, d: int) -> bool:
    """Groups the kernel reads: 32, 64 or 128 coordinates / tokens, or (per-token codes) the whole vector of a head
    dim that is a multiple of 8 (Lloyd-Max codes at d = 80, one norm per token)."""
    return codes.group in (32, 64, 128) or (not codes.tokens_last and codes.group == d and d % 8 == 0)


def _derive_coded_arguments(coded, mod):
    kc = getattr(coded.k_codec, "affine_codes", None)
    vc = getattr(coded.v_codec, "affine_codes", None)
    if kc is None or vc is None:
        return None
    ka, va = (_readable_scales(c, mod) for c in (kc(coded.k_arrays), vc(coded.v_arrays)))
    if ka is None or va is None or (ka.biases is None and ka.levels is None and not _symmetric_keys(ka, mod)) or \
            not (_group_ok(ka, coded.k_codec.d) and _group_ok(va, va.rotation.shape[0])):
        return None
    k2, v2 = ka.extra, va.extra
    if k2 is not None and (ka.tokens_last or k2.tokens_last or k2.levels is None or k2.biases is not None
                           or k2.scales.shape[-1] != 1 or k2.group % 8 or k2.rotation.shape[0] > 256):
        return None
    # RVQ keys: the second stream under the first's scales and rotation: levels summed before the dots
    k2_summed = k2 is not None and k2.scales is ka.scales and k2.rotation is ka.rotation and ka.levels is not None \
        and ka.biases is None
    if v2 is not None and (v2.scales is not va.scales or v2.rotation is not va.rotation or v2.levels is None
                           or va.levels is None or va.tokens_last):
        return None
    second = ((k2.w, None, None, k2.levels, k2.bits) if k2_summed else
              (k2.w, k2.scales, k2.rotation, k2.levels, k2.bits) if k2 is not None else (None,) * 4 + (0,))
    second += (v2.w, v2.levels, v2.bits) if v2 is not None else (None, None, 0)
    return ka, va, second


def _symmetric_keys(ka, mod) -> bool:
    """Symmetric per-token keys (``x = scale * (code - zero)``, no biases, no levels), which a module built with
    ``reads_key_zero`` reads as its coded part (``k_zero``)."""
    return getattr(mod, "reads_key_zero", False) and not ka.tokens_last and ka.zero != 0 and ka.extra is None


MAX_ROWS = 16  # query rows per KV head one call takes (the kernel's MAX_R)

# A coded part beside the main one whose codes are per token and affine (a coded tail: the budget layout's
# provisional tail, a per-token codec's old tail behind its exact window) is read from its codes in the same call
# (`_tail_arguments`: decoding it each step cost the coded-tail layout 0.82x the plain cache's decode at 4096 tokens,
# issue 47). Any further coded part of at most this many tokens joins the exact tokens decoded: a few small MLX ops,
# instead of the whole step on the reference.
DECODED_PART_TOKENS = 128


class _Exact:
    """An exact part's keys and values (a decoded small coded part)."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values

    @property
    def length(self) -> int:
        return self.keys.shape[2]


def _coded_and_exact(parts, masks, mod=None):
    """``(coded part, its mask, spans, tail, [(exact part, mask)])`` as one kernel call reads ``parts``, or None.

    One coded part is read from its codes: the only one, or the ``whole`` that several parts are slot ranges of
    (``CodedPart.within``, a window's codes on either side of its evicted slots: ``spans``, the slots read, else
    None). A second coded part whose codes are per token and affine (a cache's coded tail) is read from its codes
    too, in the same call, when ``mod`` reads one (``tail``: ``(part, mask)``, else None). Other coded parts of at
    most `DECODED_PART_TOKENS` tokens are decoded and join the exact tokens, in their place in the order (a causal
    chunk's mask counts the exact tokens from the end)."""
    coded, exact = [], []
    for i, p in enumerate(parts):
        m = None if masks is None else masks[i]
        if hasattr(p, "k_codec"):  # a CodedPart (packed_sdpa, which calls this, defines the parts)
            coded.append((i, p, m))
        elif p.keys.shape[2]:
            exact.append((i, p, m))
    if not coded:
        return None
    spans = None
    within = [c for c in coded if getattr(c[1], "within", None) is not None]
    if len(within) > 1 and all(c[1].within[0] is within[0][1].within[0] and c[2] is None for c in within):
        main, cm = within[0][1].within[0], None
        spans = sorted((c[1].within[1], c[1].within[2]) for c in within)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return None
        spans = [t for span in spans for t in span]
        taken = {c[0] for c in within}
        rest = [c for c in coded if c[0] not in taken]
    else:
        first, main, cm = max(coded, key=lambda c: c[1].length)
        rest = [c for c in coded if c[0] != first]
    tail = None
    for i, p, m in rest:
        if tail is None and getattr(mod, "reads_tail", False) and _tail_arguments(p, mod) is not None:
            tail = (p, m)
            continue
        if p.length > DECODED_PART_TOKENS:
            return None
        exact.append((i, _Exact(coded_keys(p, mx.float32), p.v_codec.decode(p.v_arrays, mx.float32)), m))
    exact.sort(key=lambda e: e[0])
    return main, cm, spans, tail, [(p, m) for _, p, m in exact]


_NONE = None  # an empty float32 array: the kernel's "not given" inside its tail and offset lists


def _none() -> mx.array:
    global _NONE
    if _NONE is None:
        _NONE = mx.zeros((0,), dtype=mx.float32)
    return _NONE


def _offset_arguments(coded: Optional[KeyOffset], coded_n: int, tail: Optional[KeyOffset], tail_n: int) -> dict:
    """The kernel's ``key_offset`` / ``offset_layout`` for the parts' key offsets (keys stored less their rotated
    mean before RoPE): the kernel turns each query back to every block's first position and reads ``R_j mu`` from
    the table (`KeyOffset.table`) with each block's turns (`KeyOffset.turns`): no MLX op per step."""
    if coded is None and tail is None:
        return {}
    frame = (coded or tail).frame
    if coded is not None and tail is not None and tail.frame != frame:
        raise LookupError("the coded part and the tail have different RoPE frames")
    arrays = []
    for o, n in ((coded, coded_n), (tail, tail_n)):
        arrays += [_none(), _none()] if o is None else [o.table(), o.turns(n)]
    return {"key_offset": arrays, "offset_layout": [frame.dims, int(frame.traditional), OFFSET_BLOCK]}


def _tail_arguments(part, mod):
    """``(arrays, layout, (k zero, v zero))`` of a coded part the kernel reads as its tail, or None: keys and values
    coded per token (groups along channels), affine or symmetric levels, no codebook, no second stream. Kept on
    the part, like `_coded_arguments`."""
    memo = part.__dict__.get("_kernel_tail")
    if memo is not None and memo[0] is mod:
        return memo[1]
    kc = getattr(part.k_codec, "affine_codes", None)
    vc = getattr(part.v_codec, "affine_codes", None)
    result = None
    if kc is not None and vc is not None:
        ka, va = (_readable_scales(c, mod) for c in (kc(part.k_arrays), vc(part.v_arrays)))
        if ka is not None and va is not None and not ka.tokens_last and not va.tokens_last and \
                ka.levels is None and va.levels is None and ka.extra is None and va.extra is None and \
                _group_ok(ka, part.k_codec.d) and _group_ok(va, va.rotation.shape[0]):
            given = lambda a: _none() if a is None else a  # noqa: E731
            arrays = [ka.w, ka.scales, given(ka.biases), va.w, va.scales, given(va.biases), ka.rotation, va.rotation,
                      given(ka.mean), given(va.mean)]
            result = (arrays, [ka.bits, ka.group, va.bits, va.group], (float(ka.zero), float(va.zero)))
    part.__dict__["_kernel_tail"] = (mod, result)
    return result


def _causal_rows(R: int, L: int, ne: int, G: int, later: int = 0) -> mx.array:
    """Bool ``(G*R*L, ne)``: query row ``(r, l)`` of ``L`` queries followed by ``later`` more chunk tokens (together
    the end of the exact tokens) sees the exact tokens before and at its own position."""
    visible = mx.arange(ne)[None, :] < (ne - later - L + 1 + mx.arange(L))[:, None]  # (L, ne)
    return mx.contiguous(mx.broadcast_to(visible[None, None], (G, R, L, ne)).reshape(G * R * L, ne))


def decode_step(queries: mx.array, parts: Sequence, scale: float, sinks: Optional[mx.array] = None,
                masks: Optional[Sequence[Optional[mx.array]]] = None, chunk: bool = False,
                later: int = 0) -> Optional[mx.array]:
    """`attend_one_query` through the compiled kernel: ``(B, Hq, 1, d)`` -> ``(B, Hq, 1, dv)``, or None when this
    step is not one it runs (then the caller runs the reference). Parts: one coded part whose codecs offer
    `affine_codes` (a second code stream included: Prod's signs, RVQ's residual codes), or several that are slot
    ranges of one (a sliding window past eviction: read in one pass), plus one per-token coded part read as the
    tail in the same pass and further small coded parts decoded (`_coded_and_exact`), any exact parts (merged: one
    query sees keys in any order).

    ``chunk``: the queries ``(B, Hq, L, d)`` are a short prompt chunk, the last ``L`` tokens stored, with mlx_lm's
    causal mask (no ``masks``), or the first ``L`` of them when ``later`` more follow (a chunk of more than
    `MAX_ROWS` rows goes in pieces): the coded tokens are all older than the chunk, so every query sees them, and
    the exact tokens get one causal mask row per (query head, query). Runs when the last part is exact and holds
    the whole chunk and ``R * L`` rows fit one call; a short chunk otherwise paid ~40 small MLX ops per layer (a
    serving request's few uncached prompt tokens: 0.83x the plain cache at 2-8 tokens after 200)."""
    mod = _usable()
    if mod is None:
        return None
    L = queries.shape[2]
    if chunk and (masks is not None or not parts or hasattr(parts[-1], "k_codec") or
                  parts[-1].keys.shape[2] < L + later):
        return None
    picked = _coded_and_exact(parts, masks, mod)
    if picked is None:
        return None
    coded, cm, spans, tail, exact = picked
    if (coded.key_offset is not None or (tail is not None and tail[0].key_offset is not None)) \
            and not getattr(mod, "reads_key_offset", False):
        return None
    args = _coded_arguments(coded, mod)
    if args is None:
        return None
    ka, va, second = args
    B, Hq, L, d = queries.shape
    H = ka.w.shape[1]
    if (L != 1 and not chunk) or Hq % H or (Hq // H) * L > MAX_ROWS or ka.w.shape[0] != B:
        return None
    R, n = Hq // H, coded.length
    dv = va.rotation.shape[0]
    if d > 256 or dv > 256:  # the kernel's tile buffers hold head dims up to 256
        return None
    try:
        cmask, emask = _kernel_masks(cm, exact, B, H, n) if masks is not None else (None, None)
        tail_kw = {}
        if tail is not None:
            arrays, layout, (kz, vz) = _tail_arguments(tail[0], mod)
            tmask = _row_mask(tail[1], B, H, tail[0].length) if masks is not None else None
            tail_kw = {"tail": arrays + [_none() if tmask is None else tmask], "tail_layout": layout,
                       "tail_k_zero": kz, "tail_v_zero": vz}
    except LookupError:
        return None
    if exact:
        ek = exact[0][0].keys if len(exact) == 1 else mx.concatenate([p.keys for p, _ in exact], axis=2)
        ev = exact[0][0].values if len(exact) == 1 else mx.concatenate([p.values for p, _ in exact], axis=2)
    else:
        ek, ev = mx.zeros((B, H, 0, d)), mx.zeros((B, H, 0, dv))
    if chunk:  # rows ordered (query head r, query l) within each KV head
        emask = _causal_rows(R, L, ek.shape[2], B * H, later)
    # log2 units: the softmax is 2**s
    q = (queries.astype(mx.float32) * (scale * LOG2E)).reshape(B, H, R * L, d)
    s = None
    if sinks is not None:  # (Hq,) per query head, or (B*Hq,) for a folded batch
        s = (sinks.astype(mx.float32) * LOG2E).reshape(-1, R)
        s = mx.tile(s, (B, 1)) if s.shape[0] != B * H else s
        s = mx.contiguous(mx.repeat(s, L, axis=1) if L > 1 else s)  # (one per row)
    try:
        bias_kw = _offset_arguments(coded.key_offset, n, None if tail is None else tail[0].key_offset,
                                    0 if tail is None else tail[0].length)
    except LookupError:  # (parts of two RoPE frames: the reference takes the call)
        return None
    try:
        out = mod.coded_decode_attention(
            q, ka.rotation, va.rotation, ka.w, ka.scales, ka.biases, ka.tokens_last, ka.bits, ka.group,
            va.w, va.scales, va.biases, va.tokens_last, va.bits, va.group, float(va.zero),
            ek.astype(mx.float32), ev.astype(mx.float32), ka.mean, va.mean, cmask, emask, s, ka.levels, va.levels,
            *second, **({"spans": spans} if spans is not None else {}), **tail_kw, **bias_kw,
            **({"k_zero": float(ka.zero)} if ka.biases is None and ka.levels is None else {}))
    except (ValueError, TypeError, RuntimeError) as e:  # a layout the kernel refuses: the reference takes the call
        _refused(e)
        return None
    _calls["kernel"] += 1
    out = out.reshape(B, Hq, L, dv)
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)


__all__: List[str] = ["BUILD_HINT", "MAX_ROWS", "calls", "decode_step", "enabled", "gather_rows", "set_enabled",
                      "status"]
