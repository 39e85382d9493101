"""Issue 54's RoPE-pair lever, measured before it is built: the budget presets' codes applied on arrival and decoded
at once ("fake quantization"), so a code that the caches cannot store yet is judged by KL on real text.

``fq-bB`` (B = 4, 3, 2) is the budget preset ``tq-Bb`` as this probe computes it, to check the probe against the
real caches' KL: keys less their pre-RoPE mean ``R_t mu`` (fitted on each sequence's first chunk, stored float16 as
the cache does) and values, each rotated and coded per token on the Lloyd-Max levels of N(0, 1) with one-byte scales
per 64 coordinates (`veloxquant_mlx.codecs.token_lloyd`), the first token exact. ``fq-bB-g32``: key scales per 32
coordinates (the bytes of the split below). ``fq-bB-pairs``: the same bytes, spent otherwise on the keys -- the
half of the RoPE pairs that matters most to the scores at ``B + 1`` bits, the other half at ``B - 1``, each half
rotated on its own (d/2 x d/2) with its own one-byte scale. Which pairs: per layer and KV head, the largest
``E[q_p^2] * Var[k_p]`` (pair sums of a `veloxquant_mlx.Calibration`'s ``query_power`` and ``key_variance``, on
text that is none of the evaluation corpora): with the rotated code's error spread evenly over the coordinates it
codes, the expected squared score error of a half is its share of the key variance times its share of the query
power, so bits go where that product is large. ``fq-bB-pairs-probe``: the same, the statistics measured on the
builder's key-rotation probe instead (`PROBE_TOKENS` pseudo-random token ids, no text: what an uncalibrated preset
could use). ``fq-bB-rd`` / ``fq-bB-pairs-rd``: the same layouts with each rotated token coded at the Shannon bound
instead of by Lloyd-Max levels -- the Gaussian test channel at B code bits per coordinate (mean squared error
``s^2 2^(-2B)``, ``s^2`` the token's mean square, known exactly): what any vector or trellis code of the rotated
coordinates at the same code bits could at best approach, to judge whether a better quantizer can reach a KL goal.

The layers the preset codes per token (``token_lloyd8``) get the probe's codes at that layer's key and value bits (B
where the preset is uniform; Gemma 3's window layers 5-bit keys); layers of another layout (Gemma 3's full-attention
block keys) keep the preset's own cache. Stored bytes are the real layouts' (``options`` of the equal-bytes
configuration) plus one static permutation per layer and head for the split; attention runs on the decoded keys
(mlx_lm's plain caches, sliding windows kept), so no speed.
"""
from __future__ import annotations

import itertools
from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from veloxquant_mlx.codecs.affine_sym_log import decode_log_scales
from veloxquant_mlx.codecs.token_lloyd import gaussian_levels, reference_level_log_encode
from veloxquant_mlx.quant.bit_pack import unpack
from veloxquant_mlx.quant.rope import RopeFrame, fit_mean, frame_of, offset_keys
from veloxquant_mlx.quant.rotation import make_rotation


def lloyd_roundtrip(y: mx.array, bits: int, group: int) -> mx.array:
    """``y`` ``(..., m)`` rotated coordinates -> their per-token Lloyd-Max codes (one-byte scales per ``group``),
    decoded (the codec's arithmetic: `reference_level_log_encode`, then levels times scales)."""
    levels, inner = gaussian_levels(bits)
    w, code = reference_level_log_encode(y, levels, inner, bits, group)
    m = y.shape[-1]
    q = unpack(w, bits, m).astype(mx.int32)
    x = levels[q].reshape(*q.shape[:-1], m // group, group) * decode_log_scales(code)[..., None]
    return x.reshape(q.shape)


def shannon_roundtrip(y: mx.array, bits: int, key: mx.array) -> mx.array:
    """``y`` ``(..., m)`` -> ``y`` through the Gaussian test channel at ``bits`` per coordinate: ``a y + sqrt(a D) z``
    with ``D = s^2 2^(-2 bits)``, ``a = 1 - 2^(-2 bits)``, ``s^2`` the mean square of each row, ``z`` standard normal
    (drawn from ``key``): the error is ``D`` per coordinate and independent of the reconstruction, as at the
    rate-distortion bound of a Gaussian source."""
    a = 1.0 - 2.0 ** (-2 * bits)
    d = mx.mean(y * y, axis=-1, keepdims=True) * 2.0 ** (-2 * bits)
    return a * y + mx.sqrt(a * d) * mx.random.normal(y.shape, key=key)


def token_code(x: mx.array, bits: int, group: int, seed: int, noise=None) -> mx.array:
    """``x`` ``(B, H, T, d)`` float32 -> decoded per-token codes: rotation ``make_rotation(d, seed)``, groups of
    ``group``; ``noise`` (an ``itertools.count``): the test channel at ``bits`` (`shannon_roundtrip`, one fresh key
    per call from the counter) instead of the Lloyd-Max levels."""
    rot = make_rotation(x.shape[-1], seed)
    if noise is not None:
        return rot.invert(shannon_roundtrip(rot.apply(x), bits, mx.random.key(next(noise))))
    return rot.invert(lloyd_roundtrip(rot.apply(x), bits, group))


def pair_channels(query_power: mx.array, key_variance: mx.array, frame: RopeFrame, n_pairs: int) -> mx.array:
    """``(H, d)`` int32 permutations per KV head: the channels of the ``n_pairs`` RoPE pairs of largest
    ``E[q_p^2] * Var[k_p]`` first (both channels of each), then the rest (``query_power`` / ``key_variance``
    ``(H, d)``)."""
    import numpy as np

    q, k = np.array(query_power, dtype=np.float64), np.array(key_variance, dtype=np.float64)
    d = q.shape[-1]
    half = frame.dims // 2
    first = np.arange(0, frame.dims, 2) if frame.traditional else np.arange(half)
    second = first + 1 if frame.traditional else first + half
    out = []
    for h in range(q.shape[0]):
        weight = (q[h, first] + q[h, second]) * (k[h, first] + k[h, second])
        top = np.sort(np.argsort(-weight, kind="stable")[:n_pairs])
        chosen = np.concatenate([first[top], second[top]])
        rest = np.setdiff1d(np.arange(d), chosen)
        out.append(np.concatenate([chosen, rest]))
    return mx.array(np.stack(out).astype(np.int32))


def split_code(x: mx.array, perm: mx.array, bits_hi: int, bits_lo: int, seed: int, noise=None) -> mx.array:
    """``x`` ``(B, H, T, d)`` -> decoded codes of its channels ``perm[h, :m]`` (``m`` = d/2) at ``bits_hi`` and the
    rest at ``bits_lo``, each half rotated on its own and scaled per token (one group)."""
    B, H, T, d = x.shape
    idx = mx.broadcast_to(perm[None, :, None, :], x.shape)
    xp = mx.take_along_axis(x, idx, axis=-1)
    m = d // 2
    hi = token_code(xp[..., :m], bits_hi, m, seed, noise)
    lo = token_code(xp[..., m:], bits_lo, d - m, seed + 1, noise)
    back = mx.argsort(perm, axis=-1)
    return mx.take_along_axis(mx.concatenate([hi, lo], axis=-1), mx.broadcast_to(back[None, :, None, :], x.shape),
                              axis=-1)


class _CodedOnArrival:
    """Holds each arriving token as the codes would decode it: keys less ``R_t mu`` coded (``key_code``), values
    coded (``value_code``), the first token of the sequence exact; storage (and any window) is the plain cache's."""

    def setup(self, frame: RopeFrame, key_code, value_code, sink: int = 1, offset: bool = True):
        self.frame, self.key_code, self.value_code = frame, key_code, value_code
        self.sink, self.offset_keys = sink, offset
        self.mu: Optional[mx.array] = None  # (H, d) float32 of float16 values, fitted on the first chunk
        return self

    def update_and_fetch(self, keys, values):
        start, T = self.offset, keys.shape[2]  # offset: the absolute position, windowed or not
        k, v = keys.astype(mx.float32), values.astype(mx.float32)
        if keys.shape[0] != 1:
            raise ValueError("FakeCodedKV: one sequence per cache (the quality harness's)")
        if self.mu is None:
            self.mu = fit_mean(k, start, self.frame).astype(mx.float16).astype(mx.float32)
            if not self.offset_keys:
                self.mu = mx.zeros_like(self.mu)
        off = offset_keys(self.mu, mx.full((k.shape[1],), start, dtype=mx.int32), T, self.frame)[None]
        kq = self.key_code(k - off) + off
        vq = self.value_code(v)
        if start < self.sink:
            n = min(self.sink - start, T)
            kq = mx.concatenate([k[:, :, :n], kq[:, :, n:]], axis=2)
            vq = mx.concatenate([v[:, :, :n], vq[:, :, n:]], axis=2)
        return super().update_and_fetch(kq.astype(keys.dtype), vq.astype(values.dtype))


class FakeCodedKV(_CodedOnArrival, KVCache):
    """mlx_lm's plain cache holding the codes decoded on arrival (`_CodedOnArrival`)."""

    def __init__(self, frame: RopeFrame, key_code, value_code, sink: int = 1):
        KVCache.__init__(self)
        self.setup(frame, key_code, value_code, sink)


class FakeCodedRotatingKV(_CodedOnArrival, RotatingKVCache):
    """mlx_lm's sliding-window cache holding the codes decoded on arrival (`_CodedOnArrival`); keys without the
    offset, as the presets code window layers (post-RoPE: a window's first chunk is gone when it slides)."""

    def __init__(self, max_size: int, keep: int, frame: RopeFrame, key_code, value_code, sink: int = 1):
        RotatingKVCache.__init__(self, max_size, keep)
        self.setup(frame, key_code, value_code, sink, offset=False)


VARIANTS = ("", "-g32", "-pairs", "-pairs-probe", "-rd", "-pairs-rd")
_PROBED: dict = {}  # id(model) -> its probe statistics (measured once per process)


def probe_statistics(model):
    """A `Calibration` measured on the key-rotation probe's pseudo-random token ids (no text)."""
    import numpy as np

    import veloxquant_mlx as vq
    from veloxquant_mlx.integration.measure_calibration import PROBE_SEED, PROBE_TOKENS
    from veloxquant_mlx.integration.model_shape import vocab_size

    ids = np.random.default_rng(PROBE_SEED).integers(0, vocab_size(model), PROBE_TOKENS).tolist()
    return vq.calibrate(model, ids, description="the key-rotation probe's pseudo-random token ids")


def fake_caches(model, bits: int, variant: str, calibration=None, seed: int = 0) -> list:
    """``fq-b{bits}{variant}``'s caches for ``model``: the budget preset ``tq-{bits}b`` as the builder makes it, its
    per-token-coded layers (``token_lloyd8``) replaced by the probe's (`FakeCodedKV`, `FakeCodedRotatingKV` where
    the layer has a sliding window) at that layer's key and value bits; layers of another layout (Gemma 3's
    full-attention block keys) keep the preset's own cache. RoPE read by `frame_of`; ``-pairs`` needs
    ``calibration``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    # the test channel's draws: one counter per set of caches, so every run of a configuration draws the same noise
    noise = itertools.count(seed * 1_000_003) if variant.endswith("-rd") else None
    variant = variant.removesuffix("-rd")
    if variant == "-pairs" and calibration is None:
        raise ValueError("fq-bB-pairs needs --calibration (which pairs matter is fitted on calibration text)")
    if variant == "-pairs-probe":
        if id(model) not in _PROBED:
            _PROBED[id(model)] = probe_statistics(model)
        calibration = _PROBED[id(model)]
    from mlx_lm.models.cache import make_prompt_cache

    import veloxquant_mlx as vq

    plain = make_prompt_cache(model)
    if not all(type(c) in (KVCache, RotatingKVCache) for c in plain):
        raise ValueError("the fake-code probe takes models whose every layer has mlx_lm's KVCache or RotatingKVCache")
    built = vq.make_prompt_cache(model, f"tq-{bits}b")
    caches = []
    for i, layer in enumerate(model.layers):
        o = getattr(built[i], "options", None)
        if o is None or o.codec != "token_lloyd8":
            caches.append(built[i])
            continue
        kb, vb = o.k_bits, o.v_bits
        attn = layer.self_attn
        d = attn.k_proj.weight.shape[0] // attn.n_kv_heads
        frame, why = frame_of(attn.rope, d)
        if frame is None:
            raise ValueError(f"layer {i}: {why}")
        group = 32 if variant == "-g32" else min(64, d)
        if variant.startswith("-pairs"):
            perm = pair_channels(calibration.arrays["query_power"][i], calibration.arrays["key_variance"][i], frame,
                                 d // 4)
            key_code = lambda x, p=perm, b=kb: split_code(x, p, b + 1, b - 1, seed, noise)  # noqa: E731
        else:
            key_code = lambda x, g=group, b=kb: token_code(x, b, g, seed, noise)  # noqa: E731
        value_code = lambda x, b=vb: token_code(x, b, min(64, x.shape[-1]), seed + 1000, noise)  # noqa: E731
        if type(plain[i]) is RotatingKVCache:
            caches.append(FakeCodedRotatingKV(plain[i].max_size, plain[i].keep, frame, key_code, value_code))
        else:
            caches.append(FakeCodedKV(frame, key_code, value_code))
    return caches
