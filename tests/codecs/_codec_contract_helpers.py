"""Helpers, fixtures and constants shared by `test_contract.py`, `test_contract_checks.py` and `test_lloyd_max.py`."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.codecs import CODECS, CodecLayout
from veloxquant_mlx.codecs.contract import CodeField

H = 3


def _bits(cls, prefer=4):
    return prefer if prefer in cls.BITS else cls.BITS[0]


# Every (layout, role) once: the contract is per codec class, whichever layout lists it.
CASES = sorted({(name, role) for name, layout in CODECS.items() for role in ("keys", "values")})


def make(name: str, role: str, d: int = 64, bits=None, **options):
    layout = CODECS[name]
    cls = layout.keys if role == "keys" else layout.values
    b = _bits(cls) if bits is None else bits
    opts = CacheOptions(codec=name, k_bits=_bits(layout.keys, b), v_bits=_bits(layout.values, b), **options)
    return (layout.keys if role == "keys" else layout.values).from_options(opts, role, d)


def data(T: int, d: int = 64, seed: int = 0, offset: float = 0.7):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, H, T, d)).astype(np.float32) + offset * rng.standard_normal((1, H, 1, d)).astype(np.float32)
    return mx.array(x)


def fitted(name, role, d=64, T=None, seed=0, **kw):
    c = make(name, role, d, **kw)
    T = T or 2 * max(c.token_block, 32)
    x = data(T, d, seed)
    c.fit(x)
    return c, x, c.encode(x)


def rel(a, b) -> float:
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# -- a new layout is one file plus one registry line: run a model through it -----------------------------------
class BFloat16Codec(CODECS["float16"].keys):
    """A layout defined outside the package (this test file), registered with one line below."""

    BITS = (16,)

    def encode(self, x):
        return {"x": x.astype(mx.bfloat16)}

    def token_fields(self):
        return {"x": ((self.d,), mx.bfloat16)}


# -- Lloyd-Max: every method and width through the fused level planes (codecs._levels) -----------------------
# Registered configurations' (method, bits of the stored index stream) must take the fused path.
FUSED = {("turboquant_mse", 4), ("turboquant_mse", 3), ("turboquant_mse", 2), ("turboquant_prod", 4),
         ("turboquant_rvq", 2)}
LLOYD_CASES = [(m, b, o) for m in ("turboquant_mse", "turboquant_prod", "turboquant_rvq") for b in (1, 2, 3, 4)
               for o in (0, 8)] + [("turboquant_mse", 5, 0), ("turboquant_prod", 5, 8)]


def _quantizer_decode(c, codes):
    """The quantizers' own (gather) reconstruction, groups put back in channel order, mean added."""
    from veloxquant_mlx.codecs.lloyd_max import _permute

    parts = [quant.decode(c._ev(codes, g)).astype(mx.float32) for g, _, _, quant in c._groups()]
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    if c.inv_perm is not None:
        y = _permute(y, c.inv_perm)
    return y + c.mean.astype(mx.float32)[None, :, None, :]


# -- the declared contract: layout, blank fitted arrays, pure fitting -----------------------------------------
VARIANTS = [{}, {"bits": 2}, {"bits": 3}, {"bits": 8}, {"center_keys": False, "center_values": False},
            {"group_size": 32}, {"group_size": 128}, {"n_outlier_channels": 8, "value_outliers": True},
            {"method": "turboquant_prod"}, {"method": "turboquant_prod", "bits": 1},
            {"method": "turboquant_rvq", "bits": 2}]


def _settings(c) -> tuple:
    return (type(c).__name__,) + tuple(sorted((k, v) for k, v in vars(c).items()
                                              if isinstance(v, (bool, int, float, str, type(None)))))


def _contract_cases():
    cases, seen = [], set()
    for name, role in CASES:
        for variant in VARIANTS:
            try:
                c = make(name, role, **variant)
            except ValueError:  # an option this layout refuses
                continue
            if _settings(c) not in seen:
                seen.add(_settings(c))
                cases.append(pytest.param(name, role, variant, id=f"{name}-{role}-" + (
                    "-".join(f"{k}={v}" for k, v in variant.items()) or "default")))
    return cases


CONTRACT_CASES = _contract_cases()


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[f].dtype == b[f].dtype and a[f].shape == b[f].shape
                                          and bool(mx.array_equal(a[f], b[f], equal_nan=True)) for f in a)


def _fit_data(c, T=None, seed=0, rows=1):
    return data(T or 2 * max(c.token_block, 32), c.d, seed)[:rows]


def check_layout(c) -> None:
    """`code_layout` against real encodings of 1, 2 and 3 token blocks (2 rows too), for 3 heads and 1 head."""
    blk = c.token_block
    for heads in (H, 1):
        fitted = c.with_fitted(c.fitted_from(_fit_data(c)[:, :heads]))
        layout, again = c.code_layout(heads), fitted.code_layout(heads)  # declared: the same fitted or not
        assert layout == again and all(isinstance(F, CodeField) for F in layout.values())
        for F in layout.values():
            assert F.axis >= 1 and F.units >= 1 and F.block_shape[:2] == (1, heads)
            assert F.block_shape[F.axis] == F.units and F.shape(1) == F.block_shape
        for k in (1, 2, 3):
            x = data(k * blk, c.d, seed=k)[:1, :heads]
            codes = fitted.encode(x)
            assert sorted(codes) == sorted(layout), (sorted(codes), sorted(layout))
            for f, F in layout.items():
                a = codes[f]
                assert (tuple(a.shape), a.dtype) == (F.shape(k), F.dtype), (f, tuple(a.shape), a.dtype, F)
                for i in range(k):  # block i is entries [i * units, (i + 1) * units) along the token axis
                    part = a[(slice(None),) * F.axis + (slice(i * F.units, (i + 1) * F.units),)]
                    alone = fitted.encode(x[:, :, i * blk:(i + 1) * blk])[f]
                    assert part.shape == alone.shape and bool(mx.array_equal(part, alone, equal_nan=True)), (f, i)
            assert fitted.n_tokens(codes) == k * blk
        rows = fitted.encode(data(blk, c.d, seed=4)[:, :heads])  # 2 batch rows
        assert all(tuple(rows[f].shape) == F.shape(1, rows=2) for f, F in layout.items())


def check_blank_fitted(new) -> None:
    """`blank_fitted` has exactly a real fit's names, shapes and dtypes (per head), finite, and loads."""
    for heads in (H, 1, 5):
        c, real = new(), new()
        real.fit(data(2 * max(c.token_block, 32), c.d)[:1, :1].astype(mx.float32) * mx.ones((1, heads, 1, 1)))
        want, blank = real.fitted_arrays(), c.blank_fitted(heads)
        assert sorted(blank) == sorted(want)
        for name, a in blank.items():
            assert (tuple(a.shape), a.dtype) == (tuple(want[name].shape), want[name].dtype), name
            assert a.shape[0] == heads, f"fitted array {name!r} is not per head"
            assert bool(mx.all(mx.isfinite(a.astype(mx.float32)))), name
        held = c.with_fitted(blank)
        assert held.fitted and _equal(held.fitted_arrays(), blank)
        assert not c.fitted_arrays()  # the original stays unfitted
        codes = held.encode(data(c.token_block, c.d)[:1, :1] * mx.ones((1, heads, 1, 1)))
        assert bool(mx.all(mx.isfinite(held.decode(codes, mx.float32))))


def check_pure_fitting(new) -> None:
    """``with_fitted(fitted_from(x))`` codes as ``fit(x)`` does, bit for bit; the codec called on never changes."""
    c = new()
    spec = c.fitted_spec(1) if hasattr(c, "fitted_spec") else None
    x, y = _fit_data(c), data(2 * c.token_block, c.d, seed=9)
    state = (c.fitted, c.fitted_arrays())
    arrays = c.fitted_from(x)
    assert (c.fitted, _equal(c.fitted_arrays(), state[1])) == (state[0], True)  # fitted_from changes nothing
    assert all(a.shape[0] == H for a in arrays.values()), "fitted arrays are per head (axis 0)"
    twin = c.with_fitted(arrays)
    assert twin is not c and type(twin) is type(c) and twin.fitted
    assert (c.fitted, _equal(c.fitted_arrays(), state[1])) == (state[0], True)  # nor does with_fitted
    ref = new()
    ref.fit(x)
    assert _equal(ref.fitted_arrays(), arrays) and _equal(twin.fitted_arrays(), arrays)
    codes = ref.encode(y)
    assert _equal(twin.encode(y), codes)
    np.testing.assert_array_equal(np.array(twin.decode(codes, mx.float32)), np.array(ref.decode(codes, mx.float32)))
    q = data(2, c.d, seed=11)
    np.testing.assert_array_equal(np.array(twin.scores(q, codes)), np.array(ref.scores(q, codes)))
    assert _equal(c.encode(y), new().encode(y))  # the original still codes as a fresh unfitted codec

    # A fitted codec: neither another fit's arrays nor `with_fitted({})` change it; {} is the unfitted codec.
    other = ref.with_fitted(ref.fitted_from(_fit_data(c, seed=3)))
    unfitted = ref.with_fitted({})
    assert _equal(ref.fitted_arrays(), arrays) and _equal(ref.encode(y), codes)
    assert unfitted.fitted_arrays() == {} and unfitted.fitted == (not arrays) and other.fitted
    assert _equal(unfitted.encode(y), new().encode(y))

    # Validated as load_fitted, naming the array; a refused call leaves the codec as it was.
    with pytest.raises(ValueError, match="bogus"):
        ref.with_fitted({**arrays, "bogus": mx.zeros((H, 1))})
    for name, a in arrays.items():
        with pytest.raises(ValueError, match=name):
            ref.with_fitted({**arrays, name: a[..., :-1] if a.ndim > 1 and a.shape[-1] > 1 else a[None]})
        with pytest.raises(ValueError, match=name):
            ref.with_fitted({**arrays, name: a.astype(mx.float16 if a.dtype != mx.float16 else mx.float32)})
        with pytest.raises(ValueError, match=name):
            ref.load_fitted({n: b for n, b in arrays.items() if n != name} or {"bogus": a})
    assert _equal(ref.fitted_arrays(), arrays) and _equal(ref.encode(y), codes)

    # Rows are pooled: B rows fit as their tokens laid end to end (per head).
    two = data(2 * max(c.token_block, 32), c.d, seed=6)
    pooled, laid = c.fitted_from(two), c.fitted_from(mx.concatenate([two[:1], two[1:]], axis=2))
    assert sorted(pooled) == sorted(laid)
    for name, a in pooled.items():
        assert a.shape == laid[name].shape and a.shape[0] == H
        np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(laid[name].astype(mx.float32)),
                                   rtol=1e-2, atol=1e-2)
    if spec is not None:
        assert sorted(spec) == sorted(arrays)


# -- a new codec is one file plus one registry line --------------------------------------------------------------
NEW_CODEC = '''"""``absmax8``: centred per-token symmetric 8-bit codes, one float16 scale per token (a test's layout).

    y = x - mu (mu: per-head channel mean, fitted once),  s = max|y| / 127,  q = round(y / s)  (int8)
"""
from typing import Dict, Optional

import mlx.core as mx

from veloxquant_mlx.codecs.common import PerTokenLayout, clamp_to, f32, finite_channel_mean
from veloxquant_mlx.validate import check_heads, check_int


class AbsMax8Codec(PerTokenLayout):
    BITS = (8,)
    OUTLIERS = False
    GROUP_SIZES = None

    def __init__(self, d: int, bits: int = 8):
        self.d, self.bits = check_int("d", d, 1), check_int("bits", bits, 8, 8)

    @classmethod
    def from_options(cls, options, role: str, d: int):
        return cls(d, options.k_bits if role == "keys" else options.value_bits)

    def fitted_spec(self, heads: int):
        return {"mean": ((heads, self.d), mx.float32)}

    def fitted_from(self, x: mx.array) -> Dict[str, mx.array]:
        return {"mean": finite_channel_mean(f32(check_heads("x", x, self.d)))}

    def token_fields(self):
        return {"q": ((self.d,), mx.int8), "scale": ((1,), mx.float16)}

    def decoded_offset(self) -> Optional[mx.array]:
        return self.fitted_param("mean")

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        y = f32(check_heads("x", x, self.d))
        mean = self.decoded_offset()
        y = y if mean is None else y - mean[None, :, None, :]
        scale = clamp_to(mx.max(mx.abs(y), axis=-1, keepdims=True) / 127.0, mx.float16)
        s = f32(scale)
        q = mx.clip(mx.round(y / mx.where(s > 0, s, 1.0)), -127, 127).astype(mx.int8)
        return {"q": q, "scale": scale}

    def decode(self, codes: Dict[str, mx.array], dtype) -> mx.array:
        y = f32(codes["q"]) * f32(codes["scale"])
        mean = self.decoded_offset()
        return clamp_to(y if mean is None else y + mean[None, :, None, :], dtype)

    def scores(self, q: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None) -> mx.array:
        s = (q @ mx.swapaxes(f32(codes["q"]), -1, -2)) * mx.swapaxes(f32(codes["scale"]), -1, -2)
        mean = self.decoded_offset()
        return s if mean is None else s + q @ mx.expand_dims(mean, -1)[None]

    def weighted_sum(self, p: mx.array, codes: Dict[str, mx.array], packed_rows: Optional[int] = None,
                     with_offset: bool = True) -> mx.array:
        o = (p * mx.swapaxes(f32(codes["scale"]), -1, -2)) @ f32(codes["q"])
        mean = self.decoded_offset()
        if with_offset and mean is not None:
            o = o + mx.sum(p, axis=-1, keepdims=True) * mean[None, :, None, :]
        return o
'''


@pytest.fixture
def absmax8(tmp_path, monkeypatch):
    """The new layout: one file in a fresh directory on sys.path, one line in `CODECS`."""
    import importlib

    (tmp_path / "absmax8_codec.py").write_text(NEW_CODEC)
    monkeypatch.syspath_prepend(str(tmp_path))
    cls = importlib.import_module("absmax8_codec").AbsMax8Codec
    monkeypatch.setitem(CODECS, "absmax8", CodecLayout(cls, cls))  # the one registry line
    yield cls
    import sys

    sys.modules.pop("absmax8_codec", None)


def _exact_attention(q, k, v, scale):
    """Softmax attention in float64 numpy; q (B, Hq, M, d), k / v (B, H, n, d), Hq a multiple of H."""
    q, k, v = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ np.swapaxes(k, -1, -2) * scale
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v
