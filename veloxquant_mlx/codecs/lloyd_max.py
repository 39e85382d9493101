"""``lloyd_max``: TurboQuant codes (seeded rotation + per-coordinate Lloyd-Max codebook, packed indices, norms).

Per token vector x (one head, length d), around the quantizers of :mod:`veloxquant_mlx.quant.quantizers`:

1. optional centring by a per-head channel mean ``mu`` ``(H, d)`` fitted once on the first tokens: ``x - mu``
   is coded and ``mu`` added back on decode (the error then scales with ``||x - mu||``, FINDINGS.md);
2. optional outlier channels: a fixed per-head set of ``n_outliers`` channels (chosen by their energy on the
   same first tokens, before any rotation) coded by their own quantizer at ``outlier_bits``, the other
   ``d - n_outliers`` at ``bits`` (the paper's 2.5 / 3.5-bit split);
3. each channel group through ``QUANTIZERS[method](width, bits)``: rotate, code, pack.

Attention reads the codes group by group in each group's rotated basis (no inverse rotation of the history):
the query is rotated once (``q_rot = q Pi^T``), scores are ``(q_rot . levels[codes]) * norms`` and weighted
values ``((p * norms) . levels[codes])`` rotated back once after the sum. ``levels[codes]`` comes from one fused
elementwise kernel per stream (:mod:`veloxquant_mlx.codecs._levels`: bit fields cut with shifts, levels as an
exact polynomial of the code) feeding one BLAS matmul; TurboQuant-Prod adds its QJL term the same way in the
sketch space (``(q_rot S^T) . signs * gamma``). Codes wider than `_levels.MAX_POLY_BITS` bits (an 8-bit outlier
group) fall back to MLX's gather (`decode_rotated`), several times slower (benchmarks/probes/attention.py). TurboQuant-MSE
encoding fuses its index search and bit packing the same way (`_levels.CodePacker`: the quantizer's codes, bit
for bit); Prod and RVQ keys encode through their quantizers.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from veloxquant_mlx.codecs.common import PerTokenLayout, clamp_to, f32, finite_channel_mean
from veloxquant_mlx.codecs._levels import CodePacker, LevelDecoder, interleave
from veloxquant_mlx.codecs.contract import AffineCodes
from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.bit_pack import packed_words
from veloxquant_mlx.quant.quantizers import QUANTIZERS
from veloxquant_mlx.quant.quantizer_common import store_norms, unit_and_norm
from veloxquant_mlx.validate import check_heads, check_int, check_outlier_channels

GROUPS = ("o", "i")  # stored order: outlier channels first, then the inliers


@functools.lru_cache(maxsize=None)
def get_quantizer(method: str, d: int, bits: int, seed: int, rotation: str, jl_dim: Optional[int]):
    """One shared (stateless, seeded) quantizer per setting: every layer reuses the same rotation."""
    if method not in QUANTIZERS:
        raise ValueError(f"method must be one of {sorted(QUANTIZERS)}, got {method!r}")
    kwargs = {"seed": seed, "rotation": rotation}
    if jl_dim is not None and method == "turboquant_prod":  # only Prod has an m; others ignore jl_dim
        kwargs["m"] = jl_dim
    return QUANTIZERS[method](d, bits, **kwargs)


def _permute(x: mx.array, perm: mx.array) -> mx.array:
    """``x`` ``(B, H, M, d)`` with per-head channel order ``perm`` ``(H, d)``: x[..., perm[h]]."""
    return mx.take_along_axis(x, mx.broadcast_to(perm[None, :, None, :], x.shape), axis=-1)


@dataclass(frozen=True)
class _Term:
    """One additive part of a group's rotated reconstruction: ``scale * factor * (levels(codes) [@ proj])``.

    ``proj`` ``(m, width)`` maps a term kept in an ``m``-dim sketch space to the group's basis (Prod's QJL term:
    ``signs @ S``); None for terms already in it.
    """

    fields: Tuple[str, ...]  # packed streams whose levels add up (RVQ: two)
    decoder: LevelDecoder
    scale_field: str  # per-token factor (B, H, n)
    factor: float
    proj: Optional[mx.array]


@functools.lru_cache(maxsize=None)
def _fast_terms(quant) -> Optional[Tuple[_Term, ...]]:
    """``quant``'s ``decode_rotated`` as fused terms, or None (some levels have no exact polynomial: gather).

    Cached per quantizer (they are shared, `get_quantizer`), so every layer shares the decoders' compiled traces.
    """
    kind, d = quant.quantizer_type, quant.d
    if kind == "turboquant_mse":
        terms = [_Term(("indices",), LevelDecoder([(quant.codebook.centroids_np, quant.b)], d), "norms", 1.0, None)]
    elif kind == "turboquant_rvq":
        streams = [(quant.codebook1.centroids_np, quant.b), (quant.codebook2.centroids_np, quant.b)]
        terms = [_Term(("indices", "indices2"), LevelDecoder(streams, d), "norms", 1.0, None)]
    elif kind == "turboquant_prod":
        terms = [] if quant.mse is None else [
            _Term(("indices",), LevelDecoder([(quant.mse.codebook.centroids_np, quant.b - 1)], d), "norms", 1.0, None)]
        # decode_rotated adds (signs @ S) * residual_norm * sqrt(pi/2)/m; signs are 1-bit codes of levels -1, +1.
        terms.append(_Term(("signs",), LevelDecoder([(np.array([-1.0, 1.0]), 1)], quant.m), "residual_norm",
                           quant._qjl_scale, quant.qjl_matrix))
    else:
        return None
    return tuple(terms) if all(t.decoder.exact for t in terms) else None


def _evaluated(a) -> mx.array:
    a = mx.array(np.asarray(a, dtype=np.float32))
    mx.eval(a)
    return a


@functools.lru_cache(maxsize=None)
def _kernel_streams(quant):
    """``quant``'s codes as the compiled attention reads them: ``((field, bits, levels, scale field), ...)`` per
    stream, the first stream's rotation and, for a second stream of keys in its own space, its ``(m, d)`` query
    map (Prod: ``qjl_scale * S @ Pi``); None for a quantizer it does not read. Shared, evaluated once."""
    kind = quant.quantizer_type
    if kind == "turboquant_mse":
        return (("indices", quant.b, _evaluated(quant.codebook.centroids_np), "norms"),), quant.rotation.matrix, None
    if kind == "turboquant_rvq":  # y = norm * (c1[i1] + c2[i2]): two streams under one norm and one rotation
        return ((("indices", quant.b, _evaluated(quant.codebook1.centroids_np), "norms"),
                 ("indices2", quant.b, _evaluated(quant.codebook2.centroids_np), "norms")),
                quant.rotation.matrix, quant.rotation.matrix)
    if kind == "turboquant_prod" and quant.mse is not None and quant.m % 8 == 0 and quant.m <= 256:
        # y = norm * c[i] + residual_norm * qjl_scale * (signs @ S): the signs score against (qjl_scale S Pi) q
        proj = (quant.qjl_matrix @ quant.rotation.matrix) * quant._qjl_scale
        mx.eval(proj)
        return ((("indices", quant.b - 1, _evaluated(quant.mse.codebook.centroids_np), "norms"),
                 ("signs", 1, _evaluated([-1.0, 1.0]), "residual_norm")), quant.rotation.matrix, proj)
    return None


@functools.lru_cache(maxsize=None)
def _packer(quant) -> Optional[CodePacker]:
    """The fused index packer of a TurboQuant-MSE quantizer (None: its own encode)."""
    if quant.quantizer_type != "turboquant_mse":
        return None
    packer = CodePacker(quant.codebook.boundaries_np, quant.b, quant.d)
    return packer if packer.exact else None


def _encode_mse(quant, packer: CodePacker, x: mx.array) -> Dict[str, mx.array]:
    """``quant.encode(x).arrays()`` (float32 ``x``) with the index quantization and packing fused (same arrays)."""
    u, norms = unit_and_norm(x)
    return {"indices": packer(quant.rotation.apply(u)), "norms": store_norms(norms, quant.norm_dtype)}


class _TokenEncoder:
    """``quant``'s encode of one token per row (a decode step) as one `mx.compile`d graph: a decode step codes a
    token per layer, and eagerly that is 20-60 small MLX operations of ~10 us each on CPU (TurboQuant-Prod keys
    0.86 ms per layer, compiled 0.38, measured alone: BENCHMARKS.md, issue 29's section); the same arrays bit for bit
    (tests/codecs/test_lloyd_max.py). Longer inputs (prompt chunks, of many shapes) stay eager."""

    def __init__(self, quant):
        packer = _packer(quant)
        self._fn = mx.compile((lambda x: quant.encode(x).arrays()) if packer is None else
                              (lambda x: _encode_mse(quant, packer, x)))
        self._lock = threading.Lock()  # tracing mutates the compiled function's cache

    def __call__(self, x: mx.array) -> Dict[str, mx.array]:
        with self._lock:
            return self._fn(x)


@functools.lru_cache(maxsize=None)
def _token_encoder(quant) -> _TokenEncoder:
    return _TokenEncoder(quant)


def _stream_bits(quant, field: str) -> int:
    """Bits per code of a stored stream (sign bits: 1)."""
    if field == "signs":
        return 1
    return quant.b - 1 if quant.quantizer_type == "turboquant_prod" else quant.b


# The stored streams of each quantizer (per token: packed uint32 words, or one norm): `_quantizer_fields`.
_STREAMS = {"turboquant_mse": ("indices", "norms"), "turboquant_rvq": ("indices", "norms", "indices2"),
            "turboquant_prod": ("indices", "norms", "signs", "residual_norm")}


def _quantizer_fields(quant) -> Dict[str, tuple]:
    """``{field: (shape after (B, H, n), dtype)}`` of ``quant.encode(x).arrays()`` for ``x`` ``(B, H, n, width)``."""
    if quant.quantizer_type not in _STREAMS:
        raise ValueError(f"no stored layout known for quantizer {quant.quantizer_type!r}")
    out = {}
    for f in _STREAMS[quant.quantizer_type]:
        if f in ("norms", "residual_norm"):
            out[f] = ((), quant.norm_dtype)
        else:  # signs: one bit per sketch coordinate (m); indices: the group's width (none for 1-bit Prod)
            bits = _stream_bits(quant, f)
            out[f] = ((packed_words(quant.m if f == "signs" else quant.d, bits) if bits else 0,), mx.uint32)
    return out


def _packed(quant, terms, codes: Dict[str, mx.array], g: str) -> bool:
    """Whether a group's stored streams are the packed uint32 words the fused decoders read."""
    for t in terms:
        width = t.decoder.d
        for f in t.fields:
            a = codes.get(f"{g}_{f}")
            if a is None or a.dtype != mx.uint32 or a.shape[-1] != packed_words(width, _stream_bits(quant, f)):
                return False
    return True


class LloydMaxCodec(PerTokenLayout):
    """Codes ``(B, H, T, d)`` tensors as ``{"<group>_<field>": (B, H, T, ...)}`` packed arrays and back."""

    BITS = tuple(range(1, 9))
    OUTLIERS = True  # supports outlier channels
    GROUP_SIZES = None  # no affine groups

    def __init__(self, method: str, d: int, bits: int, *, seed: int = 0, rotation: str = "haar",
                 jl_dim: Optional[int] = None, n_outliers: int = 0, outlier_bits: int = 8, center: bool = True):
        self.d, self.bits = check_int("d", d, 2), check_int("bits", bits, 1, 8)
        check_outlier_channels("n_outlier_channels", n_outliers, self.d, min_group=2)
        self.method, self.seed, self.rotation, self.jl_dim = method, int(seed), rotation, jl_dim
        self.n_outliers, self.outlier_bits, self.center = int(n_outliers), int(outlier_bits), bool(center)
        # Group name -> (width, bits, seed offset). "i": inlier channels, "o": outlier channels.
        self.groups = {"i": (self.d - self.n_outliers, self.bits, 0)}
        if self.n_outliers:
            self.groups["o"] = (self.n_outliers, self.outlier_bits, 1)
        self.quantizers = {g: get_quantizer(method, w, b, self.seed + off, rotation, jl_dim)
                           for g, (w, b, off) in self.groups.items()}
        # Fitted per-head parameters, kept compact: the mean in bfloat16 (encode subtracts and decode adds
        # back the same rounded value, so the rounding costs nothing), outlier channel indices as uint8.
        self.mean: Optional[mx.array] = None  # (H, d) bfloat16
        self.outliers: Optional[mx.array] = None  # (H, n_outliers)
        self.perm: Optional[mx.array] = None  # (H, d) int32: outlier channels first, then the rest
        self.inv_perm: Optional[mx.array] = None

    @classmethod
    def from_options(cls, options, role: str, d: int) -> "LloydMaxCodec":
        """The keys' or values' codec of a cache (values get their own seed, and MSE codes for Prod)."""
        if role == "keys":
            return cls(options.method, d, options.k_bits, seed=options.seed, rotation=options.rotation,
                       jl_dim=options.jl_dim, n_outliers=options.n_outlier_channels,
                       outlier_bits=options.outlier_bits, center=options.center_keys)
        # The QJL sketch makes inner products unbiased, which only scores need; for values (aggregated, not
        # scored) it spends bits on a higher-variance reconstruction, so Prod values use MSE codes.
        method = "turboquant_mse" if options.method == "turboquant_prod" else options.method
        return cls(method, d, options.v_bits, seed=options.seed + 1000, rotation=options.rotation,
                   n_outliers=options.n_outlier_channels if options.value_outliers else 0,
                   outlier_bits=options.outlier_bits, center=options.center_values)

    def _groups(self):
        """``(group, start, width, quantizer)`` in stored order."""
        out, start = [], 0
        for g in GROUPS:
            if g in self.groups:
                width = self.groups[g][0]
                out.append((g, start, width, self.quantizers[g]))
                start += width
        return out

    def _ev(self, codes: Dict[str, mx.array], g: str):
        fields = {k[len(g) + 1:]: v for k, v in codes.items() if k.startswith(g + "_")}
        return EncodedVector(quantizer_type=self.method, dim=self.groups[g][0], dtype_name="float32", **fields)

    # -- fitting: mean (H, d) bfloat16 when centred, outlier channels (H, n_outliers) when any ---------------
    def fitted_spec(self, heads: int):
        spec = {"mean": ((heads, self.d), mx.bfloat16)} if self.center else {}
        if self.n_outliers:
            spec["outliers"] = ((heads, self.n_outliers), mx.uint8 if self.d <= 256 else mx.uint16)
        return spec

    def fitted_from(self, x: mx.array) -> Dict[str, mx.array]:
        xf, out = f32(check_heads("x", x, self.d)), {}
        if self.center:
            out["mean"] = finite_channel_mean(xf).astype(mx.bfloat16)  # (H, d)
            xf = xf - out["mean"].astype(mx.float32)[None, :, None, :]
        if self.n_outliers:
            energy = finite_channel_mean(xf * xf)  # (H, d): channel energy after centring
            top = mx.argsort(-energy, axis=-1)[:, : self.n_outliers]
            out["outliers"] = mx.sort(top, axis=-1).astype(self.fitted_spec(1)["outliers"][1])
        return out

    def blank_fitted(self, heads: int) -> Dict[str, mx.array]:
        out = super().blank_fitted(heads)
        if "outliers" in out:  # distinct channels (a valid permutation), not n copies of channel 0
            out["outliers"] = mx.broadcast_to(mx.arange(self.n_outliers), out["outliers"].shape).astype(
                out["outliers"].dtype)
        return out

    def check_fitted(self, arrays: Dict[str, mx.array]) -> Dict[str, mx.array]:
        arrays = super().check_fitted(arrays)
        if "outliers" in arrays and mx.any(arrays["outliers"] >= self.d).item():
            raise ValueError(f"fitted array 'outliers' must be (H, {self.n_outliers}) channel indices < {self.d}")
        return arrays

    def _set_fitted(self, arrays: Dict[str, mx.array]) -> None:
        self.mean = arrays.get("mean")
        self.set_outliers(arrays.get("outliers"))

    def set_outliers(self, outliers: Optional[mx.array]) -> None:
        """Store the outlier channels ``(H, n)`` and derive the channel permutation from them."""
        self.outliers = outliers
        if outliers is None:
            self.perm = self.inv_perm = None
            return
        H = outliers.shape[0]
        # Sort key: outlier channels get c - d (negative, keeps their order), the others c.
        key = mx.broadcast_to(mx.arange(self.d, dtype=mx.int32), (H, self.d))
        is_out = mx.put_along_axis(mx.zeros((H, self.d), dtype=mx.int32), outliers.astype(mx.int32),
                                   mx.array(1, dtype=mx.int32), axis=-1)
        self.perm = mx.argsort(key - self.d * is_out, axis=-1).astype(mx.int32)
        self.inv_perm = mx.argsort(self.perm, axis=-1).astype(mx.int32)

    def fitted_arrays(self) -> Dict[str, mx.array]:
        out = {}
        if self.mean is not None:
            out["mean"] = self.mean
        if self.outliers is not None:
            out["outliers"] = self.outliers
        return out

    # -- coding -----------------------------------------------------------------------------------
    def token_fields(self):
        return {f"{g}_{f}": spec for g, _, _, quant in self._groups() for f, spec in _quantizer_fields(quant).items()}

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        xf = f32(x)
        if self.mean is not None:
            xf = xf - self.mean.astype(mx.float32)[None, :, None, :]
        if self.perm is not None:
            xf = _permute(xf, self.perm)
        out: Dict[str, mx.array] = {}
        one_token = xf.ndim == 4 and xf.shape[2] == 1
        for g, start, width, quant in self._groups():
            xg = xf[..., start: start + width] if width != self.d else xf
            packer = _packer(quant)
            if one_token:
                arrays = _token_encoder(quant)(xg)
            else:
                arrays = quant.encode(xg).arrays() if packer is None else _encode_mse(quant, packer, xg)
            out.update({f"{g}_{field}": arr for field, arr in arrays.items()})
        return out

    # -- attention on codes -----------------------------------------------------------------------
    def _fast(self, g: str, quant, codes: Dict[str, mx.array]):
        """The fused terms of group ``g`` when its codes can be read by them, else None (gather path)."""
        terms = _fast_terms(quant)
        return terms if terms is not None and _packed(quant, terms, codes, g) else None

    def _term_levels(self, g: str, t: _Term, codes: Dict[str, mx.array]):
        """``(P level planes (B, H, n, width_t / P) float32, per-token scale (B, H, n) float32)`` of one term."""
        scale = codes[f"{g}_{t.scale_field}"].astype(mx.float32)
        return t.decoder(*(codes[f"{g}_{f}"] for f in t.fields)), scale * t.factor if t.factor != 1.0 else scale

    def _rotated(self, g: str, quant, codes: Dict[str, mx.array]) -> mx.array:
        """Group ``g``'s float32 reconstruction ``(B, H, n, width)`` in its rotated basis."""
        terms = self._fast(g, quant, codes)
        if terms is None:
            return quant.decode_rotated(self._ev(codes, g))
        out = None
        for t in terms:
            planes, scale = self._term_levels(g, t, codes)
            part = interleave(planes) * scale[..., None]
            part = part if t.proj is None else part @ t.proj
            out = part if out is None else out + part
        return out

    def decode(self, codes: Dict[str, mx.array], dtype) -> mx.array:
        parts = [quant.rotation.invert(self._rotated(g, quant, codes)) for g, _, _, quant in self._groups()]
        xf = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        if self.inv_perm is not None:
            xf = _permute(xf, self.inv_perm)
        if self.mean is not None:
            xf = xf + self.mean.astype(mx.float32)[None, :, None, :]
        return clamp_to(xf, dtype)

    def decoded_offset(self) -> Optional[mx.array]:
        return None if self.mean is None else self.mean.astype(mx.float32)

    def _group_scores(self, g: str, quant, q_rot: mx.array, codes: Dict[str, mx.array]) -> mx.array:
        """``q_rot`` ``(B, H, M, width)`` (rotated) against group ``g``'s codes -> ``(B, H, M, n)``."""
        terms = self._fast(g, quant, codes)
        if terms is None:
            return q_rot @ mx.swapaxes(quant.decode_rotated(self._ev(codes, g)), -1, -2)
        s = None
        for t in terms:  # norms scale whole key rows: applied to the (M, n) scores, not the (n, d) levels
            planes, scale = self._term_levels(g, t, codes)
            qt = q_rot if t.proj is None else q_rot @ mx.swapaxes(t.proj, 0, 1)
            step = len(planes)
            part = qt[..., 0::step] @ mx.swapaxes(planes[0], -1, -2)
            for j in range(1, step):  # plane j holds coordinates j::P; addmm: the sum in the matmul
                part = mx.addmm(part, qt[..., j::step], mx.swapaxes(planes[j], -1, -2))
            part = part * mx.expand_dims(scale, -2)
            s = part if s is None else s + part
        return s

    def _group_values(self, g: str, quant, p: mx.array, codes: Dict[str, mx.array]) -> mx.array:
        """``p`` ``(B, H, M, n)`` times group ``g``'s rotated values -> ``(B, H, M, width)`` (still rotated)."""
        terms = self._fast(g, quant, codes)
        if terms is None:
            return p @ quant.decode_rotated(self._ev(codes, g))
        o = None
        for t in terms:  # the per-token scale goes on the (M, n) weights, not the (n, d) levels
            planes, scale = self._term_levels(g, t, codes)
            ps = p * mx.expand_dims(scale, -2)
            part = interleave([ps @ pl for pl in planes])
            part = part if t.proj is None else part @ t.proj
            o = part if o is None else o + part
        return o

    def scores(self, q: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None) -> mx.array:
        # Every row count reads levels once and multiplies with BLAS, so packed_rows has nothing to choose.
        qp = _permute(q, self.perm) if self.perm is not None else q
        s = None
        for g, start, width, quant in self._groups():
            part = self._group_scores(g, quant, quant.rotation.apply(qp[..., start: start + width]), codes)
            s = part if s is None else s + part
        if self.mean is not None:  # q . mu: one number per query row
            s = s + q @ mx.expand_dims(self.mean.astype(mx.float32), -1)[None]
        return s

    def affine_codes(self, codes: Dict[str, mx.array]) -> Optional[AffineCodes]:
        """TurboQuant codes without outlier channels as codebook fields per token (one norm per token, levels from
        the codebook; RVQ's and Prod's second stream as `AffineCodes.extra`): what the compiled attention reads.
        None for outlier channels, 1-bit Prod (no MSE stage) or head dims the kernel does not read (multiples of 8
        up to 256: one group of the whole vector)."""
        if self.n_outliers or self.d % 8 or self.d > 256:
            return None
        streams = _kernel_streams(self.quantizers["i"])
        if streams is None or any(f"i_{f}" not in codes or f"i_{sf}" not in codes for f, _, _, sf in streams[0]):
            return None
        (f1, b1, lev1, s1), *rest = streams[0]
        rotation = streams[1]
        scales = mx.expand_dims(codes[f"i_{s1}"], -1)  # (B, H, n, 1): one norm per token
        extra = None
        if rest:
            f2, b2, lev2, s2 = rest[0]
            width = self.d if f2 != "signs" else self.quantizers["i"].m
            extra = AffineCodes(codes[f"i_{f2}"], scales if s2 == s1 else mx.expand_dims(codes[f"i_{s2}"], -1),
                                None, b2, width, False, rotation if s2 == s1 else streams[2], None, 0.0, lev2)
        mean = None if self.mean is None else self.mean.astype(mx.float32)
        return AffineCodes(codes[f"i_{f1}"], scales, None, b1, self.d, False, rotation, mean, 0.0, lev1, extra)

    def weighted_sum(self, p: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None,
                     with_offset: bool = True) -> mx.array:
        pieces = [quant.rotation.invert(self._group_values(g, quant, p, codes)) for g, _, _, quant in self._groups()]
        o = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)
        if self.inv_perm is not None:
            o = _permute(o, self.inv_perm)
        if with_offset and self.mean is not None:
            o = o + mx.sum(p, axis=-1, keepdims=True) * self.mean.astype(mx.float32)[None, :, None, :]
        return o

    def __repr__(self):
        return (f"LloydMaxCodec({self.method!r}, d={self.d}, bits={self.bits}, seed={self.seed}, "
                f"rotation={self.rotation!r}, n_outliers={self.n_outliers}, center={self.center})")

