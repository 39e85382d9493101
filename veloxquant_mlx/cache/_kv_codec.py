"""`ChannelCodec`: turns one stream of head vectors (keys, or values) into packed TurboQuant codes and back.

It composes three steps around the quantizers of :mod:`veloxquant_mlx.quantizers`, none of which is new math:

1. optional centering by a per-head channel mean ``mu`` (``(H, d)``, fitted once from the first tokens
   it sees and then frozen): ``x - mu`` is coded and ``mu`` is added back on decode, so the reconstruction
   is of ``x`` itself while the quantization error scales with ``||x - mu||`` (FINDINGS.md);
2. optional outlier channels: a fixed per-head set of ``n_outliers`` channels, chosen by their spread
   on the same first tokens, before any rotation, is coded by its own quantizer at ``outlier_bits``; the
   other ``d - n_outliers`` channels at ``bits`` (the paper's 2.5 / 3.5-bit split);
3. each group goes through ``QUANTIZERS[method](width, bits)``: rotate, Lloyd-Max code, pack.

Everything is vectorized over ``(B, H, T)``; per-head parameters broadcast.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

import mlx.core as mx

_FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


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


def check_float_heads(name: str, x, d: Optional[int] = None) -> None:
    """Validate a ``(B, H, T, d)`` floating tensor (clear errors instead of failures inside MLX)."""
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array of shape (B, H, T, d), got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must have shape (B, H, T, d), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{name} must be float32, float16 or bfloat16, got {x.dtype} (integer inputs are not KV tensors)"
        )
    if d is not None and x.shape[-1] != d:
        raise ValueError(f"{name} has head_dim {x.shape[-1]}, but the cache was set up for head_dim={d}")


class ChannelCodec:
    """Codes ``(B, H, T, d)`` tensors as a dict of packed arrays (token axis 2) and decodes them back."""

    def __init__(
        self,
        method: str,
        d: int,
        bits: int,
        *,
        seed: int = 0,
        rotation: str = "haar",
        jl_dim: Optional[int] = None,
        n_outliers: int = 0,
        outlier_bits: int = 8,
        center: bool = True,
    ):
        if n_outliers and not (2 <= n_outliers <= d - 2):
            raise ValueError(
                f"n_outlier_channels must be 0 or in 2..head_dim-2 = 2..{d - 2} (each channel group "
                f"needs >= 2 coordinates), got {n_outliers}"
            )
        self.method, self.d, self.bits = method, int(d), int(bits)
        self.seed, self.rotation, self.jl_dim = int(seed), rotation, jl_dim
        self.n_outliers, self.outlier_bits, self.center = int(n_outliers), int(outlier_bits), bool(center)
        # Group name -> (width, bits, seed offset). "i": inlier channels, "o": outlier channels.
        self.groups = {"i": (self.d - self.n_outliers, self.bits, 0)}
        if self.n_outliers:
            self.groups["o"] = (self.n_outliers, self.outlier_bits, 1)
        self.quantizers = {
            g: get_quantizer(method, w, b, self.seed + off, rotation, jl_dim)
            for g, (w, b, off) in self.groups.items()
        }
        # Fitted per-head parameters (stored with the cache, so kept compact): the channel mean in
        # bfloat16 — encode subtracts and decode adds back the same rounded value, so the rounding costs
        # nothing — and the outlier channel indices as uint8 (uint16 past 256 channels).
        self.mean: Optional[mx.array] = None  # (H, d) bfloat16
        self.outliers: Optional[mx.array] = None  # (H, n_outliers)
        self._perm: Optional[mx.array] = None  # (H, d) int32: outlier channels first, then the rest
        self._inv_perm: Optional[mx.array] = None

    # -- channel order (read by attention on codes) ------------------------------------------------
    @property
    def perm(self) -> Optional[mx.array]:
        """``(H, d)`` int32 stored channel order (outlier channels first), or None without outliers."""
        return self._perm

    @property
    def inv_perm(self) -> Optional[mx.array]:
        """``(H, d)`` int32 inverse of `perm` (stored order -> input channel order), or None."""
        return self._inv_perm

    # -- fitting (once, on the first tokens) ----------------------------------------------------
    @property
    def fitted(self) -> bool:
        return self.mean is not None or self.outliers is not None or not (self.center or self.n_outliers)

    def fit(self, x: mx.array) -> None:
        """Fix ``mu`` and the outlier channels from ``x`` ``(B, H, T, d)``; later tokens reuse them."""
        xf = x.astype(mx.float32)
        if self.center:
            self.mean = mx.mean(xf, axis=(0, 2)).astype(mx.bfloat16)  # (H, d)
            xf = xf - self.mean.astype(mx.float32)[None, :, None, :]
        if self.n_outliers:
            energy = mx.mean(xf * xf, axis=(0, 2))  # (H, d): channel energy after centering
            top = mx.argsort(-energy, axis=-1)[:, : self.n_outliers]
            self.set_outliers(mx.sort(top, axis=-1).astype(mx.uint8 if self.d <= 256 else mx.uint16))

    def set_outliers(self, outliers: Optional[mx.array]) -> None:
        """Store the outlier channels ``(H, n)`` and derive the channel permutation from them."""
        self.outliers = outliers
        if outliers is None:
            self._perm = self._inv_perm = None
            return
        H = outliers.shape[0]
        # Sort key: outlier channels get key c - d (negative, keeps their order), the others c.
        key = mx.broadcast_to(mx.arange(self.d, dtype=mx.int32), (H, self.d))
        is_out = mx.zeros((H, self.d), dtype=mx.int32)
        is_out = mx.put_along_axis(is_out, outliers.astype(mx.int32), mx.array(1, dtype=mx.int32), axis=-1)
        self._perm = mx.argsort(key - self.d * is_out, axis=-1).astype(mx.int32)
        self._inv_perm = mx.argsort(self._perm, axis=-1).astype(mx.int32)

    # -- coding ----------------------------------------------------------------------------------
    def _permute(self, x: mx.array, perm: mx.array) -> mx.array:
        idx = mx.broadcast_to(perm[None, :, None, :], x.shape)
        return mx.take_along_axis(x, idx, axis=-1)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        """``(B, H, T, d)`` -> ``{"<group>_<field>": (B, H, T, ...)}`` packed arrays."""
        xf = x.astype(mx.float32)
        if self.mean is not None:
            xf = xf - self.mean.astype(mx.float32)[None, :, None, :]
        if self._perm is not None:
            xf = self._permute(xf, self._perm)
        out: Dict[str, mx.array] = {}
        start = 0
        for g in ("o", "i"):
            if g not in self.groups:
                continue
            width = self.groups[g][0]
            ev = self.quantizers[g].encode(xf[..., start : start + width])
            start += width
            for field, arr in ev.arrays().items():
                out[f"{g}_{field}"] = arr
        return out

    def decode(self, arrays: Dict[str, mx.array], dtype) -> mx.array:
        """Inverse of :meth:`encode` for ``n`` stored tokens: returns ``(B, H, n, d)`` in ``dtype``."""
        from veloxquant_mlx.core.context import EncodedVector

        parts = []
        for g in ("o", "i"):
            if g not in self.groups:
                continue
            fields = {k[len(g) + 1 :]: v for k, v in arrays.items() if k.startswith(g + "_")}
            ev = EncodedVector(
                quantizer_type=self.method, dim=self.groups[g][0], dtype_name="float32", **fields
            )
            parts.append(self.quantizers[g].decode(ev).astype(mx.float32))
        xf = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        if self._inv_perm is not None:
            xf = self._permute(xf, self._inv_perm)
        if self.mean is not None:
            xf = xf + self.mean.astype(mx.float32)[None, :, None, :]
        return xf.astype(dtype)

    # -- state -------------------------------------------------------------------------------------
    def fitted_arrays(self) -> Dict[str, mx.array]:
        """The per-head parameters that must travel with the codes (counted in the cache's bytes)."""
        out = {}
        if self.mean is not None:
            out["mean"] = self.mean
        if self.outliers is not None:
            out["outliers"] = self.outliers
        return out

    def load_fitted(self, arrays: Dict[str, mx.array]) -> None:
        self.mean = arrays.get("mean")
        self.set_outliers(arrays.get("outliers"))
