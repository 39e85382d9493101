"""One contract test for every registered code layout (FAISS-style): each codec of `CODECS` passes by being listed.

What every codec must satisfy (float32 throughout): decode(encode(x)) approximates x; ``scores(q, codes)`` equals
``q . decode(codes)^T`` and ``weighted_sum(p, codes)`` equals ``p @ decode(codes)`` (1e-5 relative) on both the
packed and the decode-once paths; token slicing and concatenation commute with decoding; fitted state round
trips; zero and constant vectors stay finite; stored arrays that are not the layout's are refused by name.

The declared contract, over several bit widths and options per codec (`check_layout`, `check_blank_fitted`,
`check_pure_fitting`): ``code_layout(heads)`` is exactly what ``encode`` returns for 1, 2 and 3 token blocks (token
axis, units per block, shapes, dtypes, and where each block's entries lie); ``blank_fitted(heads)`` has the names,
shapes and dtypes of a real fit's arrays (per head, finite); ``with_fitted(fitted_from(x))`` codes bit for bit as a
codec after ``fit(x)``, and neither call changes the codec it is called on. The same checks then run a codec that
is written as one file outside the package and registered with one line (`test_a_new_codec_is_one_file_...`).
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.options import CacheOptions
from veloxquant_mlx.codecs import CODECS, Codec, CodecLayout
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

    def token_fields(self):
        return {"x": ((self.d,), mx.bfloat16)}


@pytest.mark.parametrize("codec", ["float16", "bfloat16"])
def test_a_new_layout_runs_a_model_from_its_codes(codec, monkeypatch, attention_on_codes):
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    from veloxquant_mlx.integration import make_prompt_cache, use_packed_attention

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


@pytest.mark.parametrize("method,bits,n_outliers", [("turboquant_mse", 4, 0), ("turboquant_mse", 2, 8),
                                                     ("turboquant_prod", 4, 0), ("turboquant_prod", 3, 8),
                                                     ("turboquant_rvq", 2, 0), ("turboquant_mse", 8, 0)])
def test_lloyd_max_one_token_encode_is_the_chunk_encode_bit_for_bit(method, bits, n_outliers):
    """A decode token is coded by one compiled graph (`lloyd_max._token_encoder`), a chunk eagerly: the same
    arrays for the same token, a zero token and large values included, in a batch of rows."""
    from veloxquant_mlx.codecs import LloydMaxCodec

    c = LloydMaxCodec(method, 64, bits, n_outliers=n_outliers, outlier_bits=8)
    x = mx.concatenate([data(40) * 3.0, data(40) * -0.5], axis=0)  # (2, H, 40, 64)
    x = mx.concatenate([x[:, :, :1] * 0.0, x[:, :, 1:]], axis=2)
    c.fit(x[:1])
    whole = c.encode(x)
    for t in (0, 1, 39):
        one = c.encode(x[:, :, t:t + 1])
        assert sorted(one) == sorted(whole)
        for f in whole:
            assert one[f].dtype == whole[f].dtype, f
            assert mx.array_equal(one[f], whole[f][:, :, t:t + 1]).item(), (f, t)


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


@pytest.mark.parametrize("name,role,variant", CONTRACT_CASES)
def test_code_layout_is_what_encode_returns(name, role, variant):
    check_layout(make(name, role, **variant))


@pytest.mark.parametrize("name,role,variant", CONTRACT_CASES)
def test_blank_fitted_matches_a_real_fit(name, role, variant):
    check_blank_fitted(lambda: make(name, role, **variant))


@pytest.mark.parametrize("name,role,variant", CONTRACT_CASES)
def test_fitting_without_mutation_equals_fit(name, role, variant):
    check_pure_fitting(lambda: make(name, role, **variant))


def test_every_fitted_array_is_per_head():
    """What batching rows needs: axis 0 of every fitted array is the heads (batch rows concatenate along it)."""
    for name, role in CASES:
        c = make(name, role)
        for heads in (1, 4):
            x = data(2 * max(c.token_block, 32))[:1, :1] * mx.ones((1, heads, 1, 1))
            assert all(a.shape[0] == heads for a in c.fitted_from(x).values()), (name, role)


# -- a new codec is one file plus one registry line --------------------------------------------------------------
NEW_CODEC = '''"""``absmax8``: centred per-token symmetric 8-bit codes, one float16 scale per token (a test's layout).

    y = x - mu (mu: per-head channel mean, fitted once),  s = max|y| / 127,  q = round(y / s)  (int8)
"""
from typing import Dict, Optional

import mlx.core as mx

from veloxquant_mlx.codecs._common import PerTokenLayout, clamp_to, f32, finite_channel_mean
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


def test_a_new_codec_is_one_file_and_one_registry_line(absmax8):
    for role in ("keys", "values"):
        c = make("absmax8", role, bits=8)
        assert type(c) is absmax8 and isinstance(c, Codec)
        check_layout(c)
        check_blank_fitted(lambda: make("absmax8", role, bits=8))
        check_pure_fitting(lambda: make("absmax8", role, bits=8))
        c, x, codes = fitted("absmax8", role, bits=8)
        y = c.decode(codes, mx.float32)
        assert float(mx.linalg.norm(y - x) / mx.linalg.norm(x)) < 0.01
        c.check_codes(codes, "restored")
        with pytest.raises(ValueError, match="restored"):
            c.check_codes({"q": codes["q"]}, "restored")
        rng = np.random.default_rng(1)
        for rows in (1, 64):
            q = mx.array(rng.standard_normal((2, H, rows, 64)).astype(np.float32))
            p = mx.softmax(mx.array(rng.standard_normal((2, H, rows, x.shape[2])).astype(np.float32)), axis=-1)
            assert rel(c.scores(q, codes), q @ mx.swapaxes(y, -1, -2)) < 1e-5
            assert rel(c.weighted_sum(p, codes), p @ y) < 1e-5


def _exact_attention(q, k, v, scale):
    """Softmax attention in float64 numpy; q (B, Hq, M, d), k / v (B, H, n, d), Hq a multiple of H."""
    q, k, v = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ np.swapaxes(k, -1, -2) * scale
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def test_a_new_codec_runs_in_a_real_cache(absmax8):
    """The registered name builds a cache whose attention on the codes is softmax attention on its history."""
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache

    cache = TurboQuantPackedCache(codec="absmax8", k_bits=8)
    rng = np.random.default_rng(3)
    rand = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    seen = {"k": [], "v": []}
    for T in (70, 1, 1):  # a prompt, then two decode steps
        keys, values = rand(2, H, T, 64), rand(2, H, T, 64)
        seen["k"].append(keys)
        seen["v"].append(values)
        hist = cache.update_and_fetch(keys, values)
        assert hist[0].shape[2] == cache.offset == sum(a.shape[2] for a in seen["k"])
        for heads in (H, 2 * H):  # one query head per KV head, and grouped (GQA)
            q = rand(2, heads, 1, 64)
            assert rel(cache.attend_packed(q, 0.125, None), _exact_attention(q, hist[0], hist[1], 0.125)) < 1e-4
    assert type(cache.k_codec) is absmax8 and type(cache.v_codec) is absmax8
    assert cache.k_codec.fitted and sorted(cache.k_codec.fitted_arrays()) == ["mean"]
    # The history really went through the codes: coded tokens decode with 8-bit absmax error (~0.5 %), not exactly.
    n = cache.n_coded
    exact = mx.concatenate(seen["k"], axis=2)[:, :, :n]
    assert n > 0 and 0 < rel(hist[0][:, :, :n], exact) < 0.02
