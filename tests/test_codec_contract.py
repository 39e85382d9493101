"""One contract test for every registered code layout (FAISS-style): each codec of `CODECS` passes by being listed.

What every codec must satisfy (float32 throughout): decode(encode(x)) approximates x; ``scores(q, codes)`` equals
``q . decode(codes)^T`` and ``weighted_sum(p, codes)`` equals ``p @ decode(codes)`` (1e-5 relative) on both the
packed and the decode-once paths; token slicing and concatenation commute with decoding; fitted state round
trips; zero and constant vectors stay finite; stored arrays that are not the layout's are refused by name.
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.options import CacheOptions
from veloxquant_mlx.codecs import CODECS, Codec

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


@pytest.mark.parametrize("name,role", CASES)
def test_implements_the_contract(name, role):
    c = make(name, role)
    assert isinstance(c, Codec)
    assert c.d == 64 and c.bits in type(c).BITS and c.token_block >= 1


@pytest.mark.parametrize("name,role", CASES)
def test_round_trip(name, role):
    c, x, codes = fitted(name, role)
    y = c.decode(codes, mx.float32)
    assert y.shape == x.shape and y.dtype == mx.float32 and c.n_tokens(codes) == x.shape[2]
    err = float(mx.linalg.norm(y - x) / mx.linalg.norm(x))
    # 16-bit floats: rounding only; 4-bit codes of rotated coordinates: ~0.1 (Lloyd-Max 0.097, affine 0.09).
    assert err < (1e-3 if c.bits == 16 else 0.13 if c.bits == 4 else 0.6), err
    if 8 in type(c).BITS and c.bits != 8:  # more bits, less error
        c8, _, codes8 = fitted(name, role, bits=8)
        assert float(mx.linalg.norm(c8.decode(codes8, mx.float32) - x)) < 0.2 * float(mx.linalg.norm(y - x))


@pytest.mark.parametrize("rows", [1, 64])  # the packed path (decode) and the decode-once path (prefill)
@pytest.mark.parametrize("name,role", CASES)
def test_scores_and_weighted_sum_equal_the_decoded_math(name, role, rows):
    c, x, codes = fitted(name, role)
    k = c.decode(codes, mx.float32)
    rng = np.random.default_rng(1)
    q = mx.array(rng.standard_normal((2, H, rows, 64)).astype(np.float32))
    p = mx.softmax(mx.array(rng.standard_normal((2, H, rows, x.shape[2])).astype(np.float32)), axis=-1)
    assert rel(c.scores(q, codes), q @ mx.swapaxes(k, -1, -2)) < 1e-5
    assert rel(c.weighted_sum(p, codes), p @ k) < 1e-5
    # Without the offset, the caller adds sum(p) * decoded_offset() itself.
    mu = c.decoded_offset()
    partial = c.weighted_sum(p, codes, with_offset=False)
    if mu is not None:
        partial = partial + mx.sum(p, axis=-1, keepdims=True) * mu[None, :, None, :]
    assert rel(partial, p @ k) < 1e-5


@pytest.mark.parametrize("name,role", CASES)
def test_slices_and_concatenation_commute_with_decode(name, role):
    c, x, codes = fitted(name, role)
    n, blk = c.n_tokens(codes), c.token_block
    cut = (n // 2) // blk * blk or blk
    head, tail = c.slice_tokens(codes, 0, cut), c.slice_tokens(codes, cut, n)
    assert (c.n_tokens(head), c.n_tokens(tail)) == (cut, n - cut)
    full = np.array(c.decode(codes, mx.float32))
    np.testing.assert_array_equal(np.array(c.decode(head, mx.float32)), full[:, :, :cut])
    np.testing.assert_array_equal(np.array(c.decode(tail, mx.float32)), full[:, :, cut:])
    joined = c.concat([head, tail])
    assert sorted(joined) == sorted(codes)
    assert all(mx.array_equal(joined[f], codes[f]) for f in codes)
    # Coding the halves apart gives the same codes as coding them together (tokens are coded independently).
    halves = c.concat([c.encode(x[:, :, :cut]), c.encode(x[:, :, cut:])])
    assert all(mx.array_equal(halves[f], codes[f]) for f in codes)


@pytest.mark.parametrize("name,role", CASES)
def test_fitted_state_and_code_checks_round_trip(name, role):
    c, x, codes = fitted(name, role)
    twin = make(name, role)
    twin.load_fitted(dict(c.fitted_arrays()))
    assert twin.fitted
    np.testing.assert_array_equal(np.array(twin.decode(codes, mx.float32)), np.array(c.decode(codes, mx.float32)))
    twin.check_codes(codes, "restored")  # its own codes pass
    f = sorted(codes)[0]
    bad = dict(codes)
    bad[f] = codes[f][..., :-1] if codes[f].shape[-1] > 1 else mx.concatenate([codes[f]] * 2, axis=-1)
    with pytest.raises(ValueError, match="restored"):
        twin.check_codes(bad, "restored")
    with pytest.raises(ValueError, match="restored"):
        twin.check_codes({k: v for k, v in codes.items() if k != f}, "restored")


@pytest.mark.parametrize("name,role", CASES)
@pytest.mark.parametrize("fill", [0.0, 3.0])
def test_zero_and_constant_vectors(name, role, fill):
    c = make(name, role)
    T = 2 * max(c.token_block, 32)
    x = mx.full((1, H, T, 64), fill, dtype=mx.float32)
    c.fit(x)
    y = c.decode(c.encode(x), mx.float32)
    assert bool(mx.all(mx.isfinite(y)))
    assert float(mx.abs(y - x).max()) <= 0.05 * max(fill, 1.0)


@pytest.mark.parametrize("name,role", CASES)
@pytest.mark.parametrize("d", [48, 96, 63])
def test_other_head_dims_work_or_are_refused_clearly(name, role, d):
    try:
        c = make(name, role, d)
    except ValueError as e:
        assert "d" in str(e) or "group_size" in str(e)
        return
    x = data(2 * max(c.token_block, 32), d)
    c.fit(x)
    y = c.decode(c.encode(x), mx.float32)
    assert y.shape == x.shape
    assert float(mx.linalg.norm(y - x) / mx.linalg.norm(x)) < (1e-3 if c.bits == 16 else 0.15)


def test_float16_nan_inf_and_range():
    # One non-finite token does not change how the others are coded (the fitted statistics skip it).
    checked = 0
    for name in CODECS:
        x = data(128)
        poisoned = mx.concatenate([x[:, :, :1] * float("nan"), x[:, :, 1:]], axis=2)
        clean, bad = make(name, "keys"), make(name, "keys")
        clean.fit(x[:, :, 1:])
        bad.fit(poisoned)
        for arr_clean, arr_bad in zip(clean.fitted_arrays().values(), bad.fitted_arrays().values()):
            assert bool(mx.all(mx.isfinite(arr_bad))) and bool(mx.allclose(arr_clean, arr_bad, atol=1e-6))
            checked += 1
    assert checked >= 3  # every centring layout was compared
    # Inputs near float16's limit decode to finite float16 (the reconstruction is clamped to the range).
    for name in CODECS:
        c = make(name, "values")
        T = 2 * max(c.token_block, 32)
        x = mx.clip(data(T) * 40000.0, -65504, 65504).astype(mx.float16)
        c.fit(x)
        assert bool(mx.all(mx.isfinite(c.decode(c.encode(x), mx.float16))))


def test_every_registered_layout_builds_a_cache_and_attends_from_codes():
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache

    for name, layout in CODECS.items():
        opts = CacheOptions(codec=name, k_bits=_bits(layout.keys), v_bits=_bits(layout.values), sink=2)
        cache = TurboQuantPackedCache(opts)
        x = data(130)
        hist = cache.update_and_fetch(x, x * 0.5)
        assert cache.n_coded > 0
        q = data(1, seed=5)
        ref = mx.fast.scaled_dot_product_attention(q, hist[0], hist[1], scale=0.125)
        assert rel(cache.attend_packed(q, 0.125, None), ref) < 1e-4
        assert dataclasses.asdict(cache.options)["codec"] == name


# -- a new layout is one file plus one registry line: run a model through it -----------------------------------
class BFloat16Codec(CODECS["float16"].keys):
    """A layout defined outside the package (this test file), registered with one line below."""

    BITS = (16,)

    def encode(self, x):
        return {"x": x.astype(mx.bfloat16)}

    def code_fields(self):
        return {"x": ((self.d,), mx.bfloat16)}


@pytest.mark.parametrize("codec", ["float16", "bfloat16"])
def test_a_new_layout_runs_a_model_from_its_codes(codec, monkeypatch, attention_on_codes):
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    from veloxquant_mlx.attention import use_packed_attention
    from veloxquant_mlx.cache.builder import make_prompt_cache
    from veloxquant_mlx.codecs import CodecLayout

    monkeypatch.setitem(CODECS, "bfloat16", CodecLayout(BFloat16Codec, BFloat16Codec))  # the one registry line
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=61)
    mx.random.seed(0)
    model = llama.Model(args)
    prompt = mx.array([[int(t) for t in np.random.default_rng(0).integers(0, 61, 40)]])

    def logits(caches):
        out = [model(prompt, cache=caches)[:, -1]]
        for _ in range(3):
            out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=caches)[:, -1])
        return mx.stack(out)

    ref = logits([KVCache() for _ in range(2)])
    caches = make_prompt_cache(model, codec=codec, k_bits=16, v_bits=16)
    with use_packed_attention():
        got = logits(caches)
    assert attention_on_codes["attend_packed"] == 2 * 4 and all(type(c.k_codec).__name__ == type(CODECS[codec].keys(16)).__name__ for c in caches)
    tol = 2e-3 if codec == "float16" else 1.5e-2  # 16-bit rounding of K and V only
    assert float(mx.abs(got - ref).max()) <= tol * float(mx.abs(ref).max())


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


@pytest.mark.parametrize("method,bits,n_outliers", LLOYD_CASES)
def test_lloyd_max_fused_levels_equal_the_quantizers_decode(method, bits, n_outliers):
    from veloxquant_mlx.codecs import LloydMaxCodec

    c = LloydMaxCodec(method, 64, bits, n_outliers=n_outliers, outlier_bits=8)
    x = data(300)  # not a multiple of the kernels' token bucket (256)
    c.fit(x)
    codes = c.encode(x)
    fused = {g: c._fast(g, quant, codes) is not None for g, _, _, quant in c._groups()}
    if (method, bits) in FUSED:
        assert fused["i"], "a registered configuration's codes must be read by the fused kernels"
    if n_outliers:
        assert not fused["o"], "8-bit outlier codes have no exact level polynomial: gather path"
    ref = _quantizer_decode(c, codes)
    assert rel(c.decode(codes, mx.float32), ref) < 1e-6
    rng = np.random.default_rng(2)
    for rows in (1, 7):
        q = mx.array(rng.standard_normal((2, H, rows, 64)).astype(np.float32))
        p = mx.softmax(mx.array(rng.standard_normal((2, H, rows, 300)).astype(np.float32)), axis=-1)
        assert rel(c.scores(q, codes), q @ mx.swapaxes(ref, -1, -2)) < 1e-5
        assert rel(c.weighted_sum(p, codes), p @ ref) < 1e-5


def test_level_polynomials_are_exact_or_refused():
    from veloxquant_mlx.codebooks import lloyd_max_codebook
    from veloxquant_mlx.codecs._levels import LevelDecoder, level_polynomial
    from veloxquant_mlx.dsa.bit_pack import pack

    for bits in (1, 2, 3, 4):
        cb = lloyd_max_codebook("beta", bits, d=64)
        assert level_polynomial(cb.centroids_np, bits) is not None
        for d in (8, 56, 64):  # whole units only: one byte / 3 bytes hold 2, 4, 8 codes
            idx = mx.array(np.random.default_rng(bits).integers(0, 1 << bits, (1, 2, 5, d)).astype(np.uint8))
            dec = LevelDecoder([(cb.centroids_np, bits)], d)
            planes = dec(pack(idx, bits))
            step = len(planes)
            want = np.array(mx.take(cb.centroids, idx.astype(mx.int32)))
            for j, pl in enumerate(planes):
                np.testing.assert_allclose(np.array(pl), want[..., j::step], rtol=0, atol=1e-6 * np.abs(want).max())
    assert level_polynomial(lloyd_max_codebook("beta", 5, d=64).centroids_np, 5) is None  # beyond MAX_POLY_BITS
    assert level_polynomial(np.array([-1.0, 0.1, 0.5, 1.0]), 2) is None  # not symmetric
    assert not LevelDecoder([(lloyd_max_codebook("beta", 3, d=64).centroids_np, 3)], 60).exact  # 60 % 8 != 0


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_fused_dequantize_is_mx_dequantize_bit_for_bit(bits, group_size):
    """`codecs._dequant.dequantize` (a few fused ops instead of MLX's ~30-50 on CPU) against its reference,
    ``mx.dequantize``, on whole arrays, on slices along either axis (the views a cache attends) and with float16
    and float32 scales; the fused path must be the one taken for 2, 4 and 8 bits."""
    from veloxquant_mlx.codecs import _dequant

    x = mx.array(np.random.default_rng(bits).standard_normal((2, H, 40, 512)).astype(np.float32) * 4.0)
    w, s, b = mx.quantize(x, group_size=group_size, bits=bits)
    s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
    words = group_size * bits // 32
    views = [(w, s16, b16), (w, s, b), (w[1:, :, 3:29], s16[1:, :, 3:29], b16[1:, :, 3:29]),
             (w[..., words:3 * words], s16[..., 1:3], b16[..., 1:3])]
    for wv, sv, bv in views:
        want = mx.dequantize(wv, sv.astype(mx.float32), bv.astype(mx.float32), group_size=group_size, bits=bits)
        got = _dequant.dequantize(wv, sv, bv, group_size, bits)
        assert got.dtype == mx.float32 and got.shape == want.shape
        assert bool(mx.array_equal(got, want))
    assert (_dequant._kernel(bits) is not None) == (bits in _dequant.FUSED_BITS)


def test_fused_float16_clamp_is_clip_then_cast():
    from veloxquant_mlx.codecs._common import clamp_all_to, clamp_to

    x = mx.array([1e6, -1e6, 65504.0, -3.25, 0.0, 1e-9, float("nan")])
    want = mx.clip(x, -65504.0, 65504.0).astype(mx.float16)
    a, b = clamp_all_to(mx.float16, x, 2 * x.reshape(7, 1))
    assert bool(mx.array_equal(a, want, equal_nan=True)) and a.dtype == mx.float16
    assert b.shape == (7, 1) and bool(mx.array_equal(b.reshape(-1), mx.clip(2 * x, -65504.0, 65504.0).astype(mx.float16),
                                                     equal_nan=True))
    assert bool(mx.array_equal(clamp_to(x, mx.float16), want, equal_nan=True))
    assert clamp_to(x, mx.bfloat16).dtype == mx.bfloat16 and float(clamp_to(x, mx.float32)[0]) == 1e6


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n_outliers", [0, 8])
def test_lloyd_max_fused_encode_writes_the_quantizers_codes(bits, n_outliers):
    """TurboQuant-MSE codes come from one compiled compare-and-pack kernel (codecs._levels.CodePacker): they must
    be the quantizer's own arrays bit for bit (a zero token and large values included)."""
    from veloxquant_mlx.codecs import LloydMaxCodec
    from veloxquant_mlx.codecs.lloyd_max import _packer, _permute

    c = LloydMaxCodec("turboquant_mse", 64, bits, n_outliers=n_outliers, outlier_bits=8)
    x = data(37) * 3.0
    x = mx.concatenate([x[:, :, :1] * 0.0, x[:, :, 1:]], axis=2)
    c.fit(x)
    codes = c.encode(x)
    assert (_packer(c.quantizers["i"]) is not None) == (bits <= 4)
    xf = x - c.mean.astype(mx.float32)[None, :, None, :]
    if c.perm is not None:
        xf = _permute(xf, c.perm)
    want = {}
    for g, start, width, quant in c._groups():
        want.update({f"{g}_{k}": v for k, v in quant.encode(xf[..., start: start + width]).arrays().items()})
    assert sorted(codes) == sorted(want)
    for f in want:
        assert codes[f].dtype == want[f].dtype and codes[f].shape == want[f].shape, f
        assert mx.array_equal(codes[f], want[f]).item(), f
