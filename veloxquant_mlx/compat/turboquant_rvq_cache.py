"""`TurboQuantRVQKVCache`: the seed's RVQ key cache in mlx_lm's cache protocol.

Keys are stored packed as two streams of b-bit RVQ codebook indices (stage 1: Gaussian codebook on the
rotated unit direction; stage 2: Laplace codebook on its residual; both uint32-packed, LSB-first, rows
padded to whole words, as `mx.quantize` packs) plus a bfloat16 norm per vector; they are dequantized on
every fetch. Values pass through unquantized as plain float16, whatever the input dtype (float32 and
bfloat16 inputs too): a value float16 cannot hold (|v| > 65504, inf or NaN) is refused with ValueError,
never stored as inf. Fetches return keys and values in the keys' dtype (what mlx_lm's attention uses);
bfloat16 values below float16's normal range (6.1e-5) lose precision on the way.

Per key vector at head_dim d and b bits: ``2 * ceil(d * b / 32) * 4 + 2`` bytes, e.g. 34 bytes for
d = 128, b = 1 (against 256 bytes in float16); per value vector ``2 * d_v`` bytes.

Saved state: ``state`` is exactly the four live arrays ``(packed1, packed2, norms, values)`` (four Nones
when nothing was ever stored, as mlx_lm's `KVCache` gives None for no tensor) and ``meta_state`` the seed's
four strings ``(head_dim, bits, seed, offset)``; `from_state(state, meta_state)` needs both. Everything
else a restore needs is derived or checked: the rotation is the seed's Haar rotation (the only one this
cache accepts), the word counts and padding bits of the packed streams must fit head_dim and bits, the
arrays' token count must equal the offset, norms must be bfloat16 and values float16. The seed itself
cannot be checked from the arrays (every seed decodes something).

This is the seed-faithful design, kept so its quality can be measured; the servable K+V compressed cache
is :class:`veloxquant_mlx.cache.packed_cache.TurboQuantPackedCache`. Like it, this class never defines
``bits`` (mlx_lm routes caches with ``bits`` to its affine quantized attention) — see `assigned_bits`.
"""
from __future__ import annotations

import collections
import copy
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask

from veloxquant_mlx.codecs.common import FLOAT16_MAX
from veloxquant_mlx.codecs.lloyd_max import get_quantizer
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.slot_store import SlotStore
from veloxquant_mlx.quant.bit_pack import packed_words
from veloxquant_mlx.quant.quantizer_common import to_output_dtype
from veloxquant_mlx.validate import check_heads

_FIELDS = ("indices", "indices2", "norms", "values")  # the state's order: packed1, packed2, norms, values
_META = ("head_dim", "bits", "seed", "offset")
_ROTATION = "haar"  # the seed's rotation: meta_state has no field for another
_NORM_DTYPE = mx.bfloat16  # what get_quantizer's TurboQuantRVQ (default norm_dtype) stores


def check_trim_count(n) -> int:
    """``trim``'s argument as an int >= 0, or TypeError/ValueError naming ``n``."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"trim(n): n must be an int >= 0 (tokens to drop), got {type(n).__name__} ({n!r})")
    if n < 0:
        raise ValueError(f"trim(n): n must be an int >= 0 (tokens to drop), got {n}")
    return int(n)


def as_float16_values(values: mx.array) -> mx.array:
    """``values`` as the float16 this cache stores; ValueError naming ``values`` if any would not survive."""
    # One host sync per update: an inf (or NaN) stored in a value would turn every later attention output
    # that weighs it into inf/NaN, silently. ``not peak <= max`` is also true for a NaN peak.
    peak = mx.max(mx.abs(values)).item() if values.size else 0.0
    if not peak <= FLOAT16_MAX:
        raise ValueError(
            f"values must be finite and within float16's range [-{FLOAT16_MAX:g}, {FLOAT16_MAX:g}] "
            f"(TurboQuantRVQKVCache stores values as float16), got max |values| = {peak}")
    return values.astype(mx.float16)


def parse_meta_state(meta_state) -> dict:
    """The seed's ``(head_dim, bits, seed, offset)`` strings -> dict of ints; ValueError naming the field."""
    if not isinstance(meta_state, (tuple, list)) or len(meta_state) != len(_META):
        raise ValueError(f"TurboQuantRVQKVCache: meta_state must be 4 strings {_META}, got {meta_state!r:.100}")
    out = {}
    for name, text in zip(_META, meta_state):
        # Strings only (what meta_state writes and a file holds); int("7") but not int(7.9) or int(True).
        if not isinstance(text, str) or not text.strip().isdecimal():
            raise ValueError(f"TurboQuantRVQKVCache: meta_state {name} must be a string of an integer >= 0, "
                             f"got {text!r:.40}")
        out[name] = int(text)
    return out


def _config(meta: dict):
    """The KVCacheConfig a meta_state describes; its range errors re-raised naming meta_state."""
    try:
        return KVCacheConfig(method="turboquant_rvq", head_dim=meta["head_dim"], bit_width_inlier=meta["bits"],
                             seed=meta["seed"], rotation=_ROTATION)
    except (TypeError, ValueError) as e:
        raise ValueError(f"TurboQuantRVQKVCache: meta_state {tuple(str(meta[n]) for n in _META)} does not "
                         f"describe a valid cache: {e}") from None


def _padding_is_zero(packed: mx.array, head_dim: int, bits: int) -> bool:
    """Whether the unused high bits of every row's last word are zero, as the packer leaves them.

    Catches a claimed bit width lower than the one written when both need the same word count
    (head_dim 16: 1 and 2 bits both fill one word). One host sync, at restore only.
    """
    used = head_dim * bits - 32 * (packed.shape[-1] - 1)
    if used >= 32 or packed.size == 0:
        return True
    return not mx.any(packed[..., -1] >> used).item()


def _width_ok(field: str, a: mx.array, words: int) -> bool:
    """The last axis of a state array of the right ndim: packed streams ``words``, values d_v >= 1."""
    if field == "norms":
        return True
    return a.shape[-1] == words if field.startswith("indices") else a.shape[-1] >= 1


def check_state_arrays(arrays: dict, head_dim: int, bits: int, offset: int, norm_dtype) -> None:
    """Refuse stored arrays that do not add up to ``offset`` tokens of this config; the error names the array.

    All four arrays or none (an empty cache); packed streams ``(B, H, T, words)`` uint32 with
    ``words = ceil(head_dim * bits / 32)`` and zero padding bits, norms ``(B, H, T)`` in the quantizer's
    norm dtype, values ``(B, H, T, d_v)`` float16, every ``(B, H)`` equal and ``T == offset``.
    """
    present = [f for f in _FIELDS if arrays[f] is not None]
    if not present:
        if offset != 0:
            raise ValueError(f"TurboQuantRVQKVCache state: meta_state offset={offset} but no arrays are stored")
        return
    missing = [f for f in _FIELDS if arrays[f] is None]
    if missing:
        raise ValueError(f"TurboQuantRVQKVCache state: array(s) {missing} missing (a state holds {list(_FIELDS)})")
    for f in _FIELDS:
        if not isinstance(arrays[f], mx.array):
            raise TypeError(f"TurboQuantRVQKVCache state: array {f!r} must be an mx.array, "
                            f"got {type(arrays[f]).__name__}")
    words = packed_words(head_dim, bits)
    wanted = {"indices": (4, (mx.uint32,), f"(B, H, T, {words}) uint32"),
              "indices2": (4, (mx.uint32,), f"(B, H, T, {words}) uint32"),
              "norms": (3, (norm_dtype,), f"(B, H, T) {norm_dtype}"),
              "values": (4, (mx.float16,), "(B, H, T, d_v >= 1) float16")}
    for f, (ndim, dtypes, text) in wanted.items():
        a = arrays[f]
        if a.ndim != ndim or a.dtype not in dtypes or not _width_ok(f, a, words):
            raise ValueError(f"TurboQuantRVQKVCache state: array {f!r} must be {text} for head_dim={head_dim}, "
                             f"bits={bits}; got {tuple(a.shape)} {a.dtype}")
    # (B, H, T) of each array; the majority names the odd one out.
    lead = {f: tuple(arrays[f].shape[:3]) for f in _FIELDS}
    common = collections.Counter(lead.values()).most_common(1)[0][0]
    odd = [f for f in _FIELDS if lead[f] != common]
    if odd:
        raise ValueError(f"TurboQuantRVQKVCache state: array(s) {odd} disagree on (B, H, T) with the others "
                         f"{common}: {', '.join(f'{f} {lead[f]}' for f in odd)}")
    if common[2] != offset:
        raise ValueError(f"TurboQuantRVQKVCache state: meta_state offset={offset} but the arrays hold "
                         f"{common[2]} tokens")
    for f in ("indices", "indices2"):
        if not _padding_is_zero(arrays[f], head_dim, bits):
            raise ValueError(f"TurboQuantRVQKVCache state: array {f!r} has bits set beyond head_dim={head_dim} "
                             f"codes of bits={bits} (coded at another bit width?)")


class TurboQuantRVQKVCache(KVCache):
    """KV cache whose keys are TurboQuantRVQ codes (two packed b-bit index streams + norm); values float16.

    Args:
        config: `KVCacheConfig`; consumes ``head_dim`` (required), ``bit_width_inlier`` (b, per stream) and
            ``seed``; ``rotation`` must be "haar" (the seed's, the only one ``meta_state`` can restore).
    """

    step = 256

    def __init__(self, config: Any):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        if config.head_dim is None:
            raise ValueError("config.head_dim must be set for TurboQuantRVQKVCache (got None)")
        if config.rotation != _ROTATION:
            raise ValueError(
                f"TurboQuantRVQKVCache uses the seed's {_ROTATION!r} rotation (its meta_state (head_dim, bits, "
                f"seed, offset) can restore no other): config.rotation must be {_ROTATION!r}, got {config.rotation!r}")
        super().__init__()
        self.config = config
        self._quantizer = get_quantizer(
            "turboquant_rvq", config.head_dim, config.bit_width_inlier, config.seed, config.rotation, None
        )
        self._store = SlotStore(self.step)
        self._compressed_key_bytes = 0
        self._fp16_key_bytes = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Normalize and RVQ-code the keys, store values in float16; return dequantized K and the stored V,
        both in the keys' dtype."""
        check_heads("keys", keys, self.config.head_dim)
        check_heads("values", values)
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"keys and values must agree on (B, H, T): keys {tuple(keys.shape)}, values {tuple(values.shape)}"
            )
        if keys.shape[2] == 0:
            raise ValueError(f"keys must hold at least one token (T >= 1), got shape {tuple(keys.shape)}")
        if self._store.buffers:
            held = self._store.buffers["values"]
            if tuple(keys.shape[:2]) != tuple(held.shape[:2]) or values.shape[-1] != held.shape[-1]:
                raise ValueError(
                    f"keys/values of shape {tuple(keys.shape)}/{tuple(values.shape)} do not continue this cache: "
                    f"it holds batch B={held.shape[0]}, heads H={held.shape[1]}, value dim {held.shape[-1]} "
                    "(a new sequence or batch needs a new cache)")
        stored_values = as_float16_values(values)  # checked before anything is stored
        ev = self._quantizer.encode(keys)
        self._store.append({**ev.arrays(), "values": stored_values})  # packed streams + norms
        self._compressed_key_bytes += ev.nbytes
        self._fp16_key_bytes += keys.size * 2
        self.offset += keys.shape[2]
        return self._fetch(keys.dtype)

    def _fetch(self, dtype):
        live = self._store.view()
        ev = EncodedVector(
            quantizer_type="turboquant_rvq",
            dim=self.config.head_dim,
            indices=live["indices"],
            indices2=live["indices2"],
            norms=live["norms"],
            dtype_name="float32",
        )
        # The float32 reconstruction of a key near float16's max can overshoot it by the quantization error
        # (6e4 coordinates come back as ~7.8e4): cast as is, that key would be inf. Clipped to the fetch dtype's
        # finite range instead (float32 and bfloat16 hold the overshoot).
        keys = to_output_dtype(self._quantizer.decode(ev), str(dtype).rsplit(".", 1)[-1])
        return keys, live["values"].astype(dtype)

    # -- protocol ---------------------------------------------------------------------------------
    def keys_and_values(self):
        raise NotImplementedError("TurboQuantRVQKVCache keeps no key tensor; use update_and_fetch")

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the ``n`` most recently added tokens; returns how many were dropped."""
        n = self._store.trim(check_trim_count(n))
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)

    def empty(self) -> bool:
        return self.offset == 0

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise ValueError(
            "TurboQuantRVQKVCache is already compressed; do not pass kv_bits to mlx_lm.generate with it"
        )

    @classmethod
    def merge(cls, caches):
        raise ValueError(
            "TurboQuantRVQKVCache does not support mlx_lm batch_generate with per-sequence prompt caches; "
            "run generate/stream_generate per sequence, or call batch_generate without prompt_caches."
        )

    # -- bytes ------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """True byte count of every stored array (packed key streams, norms, values), spare steps included."""
        return self._store.nbytes

    @property
    def compressed_key_bytes(self) -> int:
        """Cumulative packed key bytes written since construction (true packed size); a restored cache
        starts from the bytes of the keys it was restored with."""
        return self._compressed_key_bytes

    @property
    def fp16_key_bytes(self) -> int:
        """Cumulative float16-equivalent key bytes written since construction (for the compression ratio);
        a restored cache starts from its restored keys."""
        return self._fp16_key_bytes

    @property
    def assigned_bits(self) -> int:
        """Bits per index stream. Not named ``bits``: mlx_lm sends caches with ``bits`` to quantized SDPA."""
        return self.config.bit_width_inlier

    # -- copying and state ------------------------------------------------------------------------
    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new._store = self._store.copy()
        return new

    @property
    def state(self):
        """``(packed1, packed2, norms, values)``: the live stored arrays (``indices``, ``indices2``, ``norms``,
        ``values``), copies that later updates of this cache do not reach; four Nones before any token."""
        live = self._store.live_arrays()
        return tuple(None if live.get(f) is None else mx.array(live[f]) for f in _FIELDS)

    @state.setter
    def state(self, value) -> None:
        self._restore(state=value)

    @property
    def meta_state(self):
        """``(head_dim, bits, seed, offset)`` as strings: what `from_state` needs besides the arrays."""
        c = self.config
        return tuple(str(x) for x in (c.head_dim, c.bit_width_inlier, c.seed, self.offset))

    @meta_state.setter
    def meta_state(self, value) -> None:
        self._restore(meta_state=value)

    def _restore(self, **part) -> None:
        """The setter path (``obj.state = ...; obj.meta_state = ...``, as mlx_lm < 0.32's loader restores a
        bare ``cls.__new__`` instance): a bare instance waits for both halves; a built one keeps the other half
        of its own (its config for a new state, its arrays for a new meta_state)."""
        if "config" not in self.__dict__:
            pending = self.__dict__.setdefault("_pending", {})
            pending.update(part)
            if len(pending) < 2:
                return
            state, meta_state = pending["state"], pending["meta_state"]
        elif "state" in part:
            state = part["state"]
            n = _token_count(state)
            meta_state = self.meta_state[:3] + (str(n),)
        else:
            state, meta_state = self.state, part["meta_state"]
        rebuilt = type(self).from_state(state, meta_state)
        self.__dict__.clear()
        self.__dict__.update(rebuilt.__dict__)

    @classmethod
    def from_state(cls, state, meta_state: Optional[Any] = None) -> "TurboQuantRVQKVCache":
        """Rebuild from ``state`` ``(packed1, packed2, norms, values)`` and ``meta_state`` ``(head_dim, bits,
        seed, offset)`` strings (``meta_state`` is required; it defaults to None only to keep the signature of
        mlx_lm's ``_BaseCache.from_state(state)``).

        A state that does not add up is refused with ValueError/TypeError naming the array or field: not
        four entries, missing or wrong-shaped arrays, word counts or padding bits that do not fit head_dim and
        bits, norms or values in another dtype, an offset other than the stored token count. The arrays are
        copied: later updates of the rebuilt cache and of the arrays' source do not reach each other.
        """
        if not isinstance(state, (tuple, list)):
            raise TypeError("TurboQuantRVQKVCache.from_state: state must be a tuple (packed1, packed2, norms, "
                            f"values), got {type(state).__name__}")
        if len(state) != len(_FIELDS):
            raise ValueError(f"TurboQuantRVQKVCache.from_state: state must hold 4 entries (packed1, packed2, norms, "
                             f"values), got {len(state)}")
        if meta_state is None:
            raise ValueError("TurboQuantRVQKVCache.from_state needs meta_state = (head_dim, bits, seed, offset) as "
                             "strings (cache.meta_state): the four arrays do not say how they were coded. mlx_lm's "
                             "own load_prompt_cache passes state alone; use veloxquant_mlx.load_prompt_cache")
        meta = parse_meta_state(meta_state)
        config = _config(meta)
        arrays = dict(zip(_FIELDS, state))
        # Checked before the cache (and its head_dim x head_dim rotation) is built: a head_dim the arrays
        # do not confirm is refused first.
        check_state_arrays(arrays, config.head_dim, config.bit_width_inlier, meta["offset"], _NORM_DTYPE)
        cache = cls(config)
        if arrays["indices"] is not None:
            cache._store = SlotStore.from_arrays({f: mx.array(a) for f, a in arrays.items()}, cls.step)
            keys = (arrays["indices"], arrays["indices2"], arrays["norms"])
            cache._compressed_key_bytes = sum(a.nbytes for a in keys)
            cache._fp16_key_bytes = arrays["norms"].size * config.head_dim * 2
        cache.offset = meta["offset"]
        return cache


def _token_count(state) -> int:
    """Tokens in a state's arrays (0 for an empty state); shapes are checked by `from_state`."""
    first = state[0] if isinstance(state, (tuple, list)) and state else None
    return first.shape[2] if isinstance(first, mx.array) and first.ndim == 4 else 0
