"""``lloyd_max``: TurboQuant codes (seeded rotation + per-coordinate Lloyd-Max codebook, packed indices, norms).

Per token vector x (one head, length d), around the quantizers of :mod:`veloxquant_mlx.quantizers`:

1. optional centring by a per-head channel mean ``mu`` ``(H, d)`` fitted once on the first tokens: ``x - mu``
   is coded and ``mu`` added back on decode (the error then scales with ``||x - mu||``, FINDINGS.md);
2. optional outlier channels: a fixed per-head set of ``n_outliers`` channels (chosen by their energy on the
   same first tokens, before any rotation) coded by their own quantizer at ``outlier_bits``, the other
   ``d - n_outliers`` at ``bits`` (the paper's 2.5 / 3.5-bit split);
3. each channel group through ``QUANTIZERS[method](width, bits)``: rotate, code, pack.

Attention reads the codes group by group in each group's rotated basis (``decode_rotated``: no inverse
rotation of the history) against the query rotated per group: correct, but it materializes float32 rotated
codes, so it is slower than the affine layouts.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

import mlx.core as mx

from veloxquant_mlx.codecs._common import PerTokenLayout, clamp_to, f32, finite_channel_mean
from veloxquant_mlx.validate import check_int

GROUPS = ("o", "i")  # stored order: outlier channels first, then the inliers


@functools.lru_cache(maxsize=None)
def get_quantizer(method: str, d: int, bits: int, seed: int, rotation: str, jl_dim: Optional[int]):
    """One shared (stateless, seeded) quantizer per setting: every layer reuses the same rotation."""
    from veloxquant_mlx.quantizers import QUANTIZERS

    if method not in QUANTIZERS:
        raise ValueError(f"method must be one of {sorted(QUANTIZERS)}, got {method!r}")
    kwargs = {"seed": seed, "rotation": rotation}
    if jl_dim is not None and method == "turboquant_prod":  # only Prod has an m; others ignore jl_dim
        kwargs["m"] = jl_dim
    return QUANTIZERS[method](d, bits, **kwargs)


def _permute(x: mx.array, perm: mx.array) -> mx.array:
    """``x`` ``(B, H, M, d)`` with per-head channel order ``perm`` ``(H, d)``: x[..., perm[h]]."""
    return mx.take_along_axis(x, mx.broadcast_to(perm[None, :, None, :], x.shape), axis=-1)


class LloydMaxCodec(PerTokenLayout):
    """Codes ``(B, H, T, d)`` tensors as ``{"<group>_<field>": (B, H, T, ...)}`` packed arrays and back."""

    BITS = tuple(range(1, 9))
    OUTLIERS = True  # supports outlier channels
    GROUP_SIZES = None  # no affine groups

    def __init__(self, method: str, d: int, bits: int, *, seed: int = 0, rotation: str = "haar",
                 jl_dim: Optional[int] = None, n_outliers: int = 0, outlier_bits: int = 8, center: bool = True):
        self.d, self.bits = check_int("d", d, 2), check_int("bits", bits, 1, 8)
        if n_outliers and not (2 <= n_outliers <= d - 2):
            raise ValueError(f"n_outlier_channels must be 0 or in 2..head_dim-2 = 2..{d - 2} (each channel group "
                             f"needs >= 2 coordinates), got {n_outliers}")
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
        from veloxquant_mlx.core.context import EncodedVector

        fields = {k[len(g) + 1:]: v for k, v in codes.items() if k.startswith(g + "_")}
        return EncodedVector(quantizer_type=self.method, dim=self.groups[g][0], dtype_name="float32", **fields)

    # -- fitting ----------------------------------------------------------------------------------
    @property
    def fitted(self) -> bool:
        return self.mean is not None or self.outliers is not None or not (self.center or self.n_outliers)

    def fit(self, x: mx.array) -> None:
        xf = f32(x)
        if self.center:
            self.mean = finite_channel_mean(xf).astype(mx.bfloat16)  # (H, d)
            xf = xf - self.mean.astype(mx.float32)[None, :, None, :]
        if self.n_outliers:
            energy = finite_channel_mean(xf * xf)  # (H, d): channel energy after centring
            top = mx.argsort(-energy, axis=-1)[:, : self.n_outliers]
            self.set_outliers(mx.sort(top, axis=-1).astype(mx.uint8 if self.d <= 256 else mx.uint16))

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

    def load_fitted(self, arrays: Dict[str, mx.array]) -> None:
        mean, outliers = arrays.get("mean"), arrays.get("outliers")
        if self.center and (mean is None or mean.ndim != 2 or mean.shape[1] != self.d):
            raise ValueError(f"fitted array 'mean' must be (H, {self.d}) for a centred codec, got "
                             f"{None if mean is None else tuple(mean.shape)}")
        if self.n_outliers and (outliers is None or outliers.ndim != 2 or outliers.shape[1] != self.n_outliers
                                or mx.any(outliers >= self.d).item()):
            raise ValueError(f"fitted array 'outliers' must be (H, {self.n_outliers}) channel indices < {self.d}")
        self.mean = mean
        self.set_outliers(outliers)

    # -- coding -----------------------------------------------------------------------------------
    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        xf = f32(x)
        if self.mean is not None:
            xf = xf - self.mean.astype(mx.float32)[None, :, None, :]
        if self.perm is not None:
            xf = _permute(xf, self.perm)
        out: Dict[str, mx.array] = {}
        for g, start, width, quant in self._groups():
            ev = quant.encode(xf[..., start: start + width])
            out.update({f"{g}_{field}": arr for field, arr in ev.arrays().items()})
        return out

    def decode(self, codes: Dict[str, mx.array], dtype) -> mx.array:
        parts = [quant.decode(self._ev(codes, g)).astype(mx.float32) for g, _, _, quant in self._groups()]
        xf = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        if self.inv_perm is not None:
            xf = _permute(xf, self.inv_perm)
        if self.mean is not None:
            xf = xf + self.mean.astype(mx.float32)[None, :, None, :]
        return clamp_to(xf, dtype)

    # -- attention on codes -----------------------------------------------------------------------
    def decoded_offset(self) -> Optional[mx.array]:
        return None if self.mean is None else self.mean.astype(mx.float32)

    def scores(self, q: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None) -> mx.array:
        qp = _permute(q, self.perm) if self.perm is not None else q
        s = None
        for g, start, width, quant in self._groups():
            k_rot = quant.decode_rotated(self._ev(codes, g))  # (B, H, n, width) float32
            part = quant.rotation.apply(qp[..., start: start + width]) @ mx.swapaxes(k_rot, -1, -2)
            s = part if s is None else s + part
        if self.mean is not None:  # q . mu: one number per query row
            s = s + q @ mx.expand_dims(self.mean.astype(mx.float32), -1)[None]
        return s

    def weighted_sum(self, p: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None,
                     with_offset: bool = True) -> mx.array:
        pieces = [quant.rotation.invert(p @ quant.decode_rotated(self._ev(codes, g)))
                  for g, _, _, quant in self._groups()]
        o = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)
        if self.inv_perm is not None:
            o = _permute(o, self.inv_perm)
        if with_offset and self.mean is not None:
            o = o + mx.sum(p, axis=-1, keepdims=True) * self.mean.astype(mx.float32)[None, :, None, :]
        return o

    def __repr__(self):
        return (f"LloydMaxCodec({self.method!r}, d={self.d}, bits={self.bits}, seed={self.seed}, "
                f"rotation={self.rotation!r}, n_outliers={self.n_outliers}, center={self.center})")

