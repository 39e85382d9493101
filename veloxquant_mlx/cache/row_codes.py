"""What the codecs store for `Rows` (:mod:`veloxquant_mlx.cache.row_policy`): one codec's code slots of B rows
(`RowCodes`, a `SlotStore` of the codec's declared layout), the tail (`CodedTail`: exact tokens in and out, stored as
its coder codes them) and its coder when a layout codes its waiting tokens (`TailCoder`), and what a codec declares,
read once per configuration (`_layouts`); with the small array helpers the row modules share.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Sequence

import mlx.core as mx

from veloxquant_mlx.attention.kernel import compiled_encoder, compiled_level_encoder, compiled_sym_encoder
from veloxquant_mlx.codecs import affine_sym_log, codec_layout, token_lloyd
from veloxquant_mlx.codecs.affine_encode import set_compiled_provider
from veloxquant_mlx.quant.slot_store import TOKEN_AXIS, SlotStore

# The codecs' affine encoding runs compiled where the kernel may run (the same arrays, bit for bit): chosen here,
# where the caches code tokens, the first layer that imports both the codecs and the kernel.
set_compiled_provider(compiled_encoder)
affine_sym_log.set_compiled_provider(compiled_sym_encoder)
token_lloyd.set_compiled_provider(compiled_level_encoder)


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
        if set(k.blank_fitted(1)) - {"mean", "rope_mean"} or v.blank_fitted(1):
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


class RowCodes(SlotStore):
    """One codec's codes of B rows: a `SlotStore` of the codec's declared layout (arrays ``(B, H, ...)`` holding
    ``capacity`` token slots per row), grown ``grow`` slots at a time; each row's count of coded slots is its
    owner's (`Rows.coded`)."""

    def __init__(self, codec, layout: dict, grow: int):
        super().__init__(grow, layout, codec.token_block)

    @property
    def grow(self) -> int:
        return self.step


class CodedTail:
    """A cache's tail: exact tokens ``{"k", "v"}`` in, exact tokens out, stored as ``coder`` codes them.

    ``raw`` (a plain `SlotStore`) holds what is stored: the exact arrays themselves when ``coder`` is None, else the
    coder's per-token fields (``coder.encode({"k", "v"}) -> {field: (B, H, n, ...)}``, ``coder.decode(fields,
    dtypes) -> {"k", "v"}``, ``coder.fields(dims) -> {field: (trailing shape, dtype)}``). What reads tokens
    (`view`, `buffers`: attention, fitting, coding blocks) gets them decoded; what moves tokens between slots or rows
    (roll, cut, gather, concatenate, save, load) works on ``raw`` (`live_arrays`, `load_raw`), never re-coding.
    Bytes are ``raw``'s.
    """

    def __init__(self, step: int = 256, coder=None):
        self.raw = SlotStore(step)
        self.coder = coder
        self.dtypes: Dict[str, mx.Dtype] = {}  # the exact tokens' dtypes, "k" and "v" (from the first append)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.raw.length

    @property
    def capacity(self) -> int:
        return self.raw.capacity

    @property
    def step(self) -> int:
        return self.raw.step

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def dtype(self, name: str = "k") -> mx.Dtype:
        return self.dtypes.get(name, mx.float32)

    def fields(self, dims) -> Dict[str, tuple]:
        """``{raw field: (trailing shape, dtype)}`` for keys / values of head dims ``dims``."""
        if self.coder is None:
            return {n: ((d,), self.dtype(n)) for n, d in zip("kv", dims)}
        return self.coder.fields(dims)

    # -- exact tokens in and out ------------------------------------------------------------------
    def _encode(self, chunk: Dict[str, mx.array]) -> Dict[str, mx.array]:
        for n, a in chunk.items():
            self.dtypes.setdefault(n, a.dtype)
        if self.coder is None or not chunk or next(iter(chunk.values())).shape[TOKEN_AXIS] == 0:
            return chunk
        return self.coder.encode(chunk)

    def decode(self, raw: Dict[str, mx.array], dtypes: Optional[Dict[str, mx.Dtype]] = None) -> Dict[str, mx.array]:
        """Raw arrays (of this store, or slices of them) -> exact ``{"k", "v"}``."""
        if self.coder is None or not raw:
            return raw
        return self.coder.decode(raw, dtypes or {n: self.dtype(n) for n in "kv"})

    def append(self, chunk: Dict[str, mx.array]) -> None:
        self.raw.append(self._encode(chunk))

    def load(self, arrays: Dict[str, mx.array]) -> None:
        """Hold exact tokens ``arrays`` (coded, when coded)."""
        self.raw.load(self._encode(arrays))

    def view(self, start: int = 0, stop: Optional[int] = None) -> Dict[str, mx.array]:
        """The live tokens ``[start, stop)``, exact (decoded when coded)."""
        return self.decode(self.raw.view(start, stop))

    @property
    def buffers(self) -> Dict[str, mx.array]:
        """The stored tokens as exact arrays: the arrays themselves (spare slots included) when exact, else the live
        tokens decoded (a transient, never held)."""
        if self.coder is None:
            return self.raw.arrays
        return self.decode(self.raw.view()) if self.raw.length else {}

    # -- stored arrays, moved as they are ---------------------------------------------------------
    def live_arrays(self) -> Dict[str, mx.array]:
        """What goes into a cache's ``state``: the live part of every stored array."""
        return self.raw.view()

    def load_raw(self, arrays: Dict[str, mx.array]) -> None:
        self.raw.load(arrays)

    def trim(self, n: int) -> int:
        return self.raw.trim(n)

    def delete(self, start: int, stop: int, room: int = 1) -> None:
        self.raw.delete(start, stop, room)

    def copy(self) -> "CodedTail":
        new = CodedTail(self.raw.step, self.coder)
        new.raw, new.dtypes = self.raw.copy(), dict(self.dtypes)
        return new
