"""More bad input found by user-style runs: each refused with a TypeError/ValueError (or an HTTP 400) that names
the argument and what it may be, never a crash inside MLX, a silent inf, or a stdlib message about something else.

1. a damaged `EncodedVector` (fields replaced with ``dataclasses.replace``, as the seed's dataclass allowed, or
   assigned) given to decode; 3. a query whose batch axes do not match the codes in ``estimate_inner_product``;
4. keys near float16's maximum in the seed pages' caches. (2. ``veloxquant presets`` / ``plan`` at a head dim some
presets cannot take: tests/apps/cli/test_measure.py; 5. ``max_tokens`` past the served model's context:
tests/apps/test_server_max_tokens.py, tests/apps/test_server_requests.py, tests/apps/models/test_loader.py.)
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.quantizers import QUANTIZERS

D = 16
QUANT = {n: cls(D, 3) for n, cls in QUANTIZERS.items()}
X = mx.array(np.random.default_rng(0).standard_normal((3, D)).astype(np.float32))


def _decodes(quant, ev):
    """Every way a quantizer reads codes (each must refuse the same way)."""
    q = mx.ones((2, D))
    return [lambda: quant.decode(ev), lambda: quant.decode_rotated(ev),
            lambda: quant.estimate_inner_product(q, ev), lambda: quant.estimate_inner_product(q[0], ev)]


# --- 1. damaged EncodedVector -----------------------------------------------------------------------------------
# (label, fields given to dataclasses.replace, error, words the message must hold)
REPLACED = [
    ("norms-text", dict(norms="big"), TypeError, ["EncodedVector.norms", "mx.array"]),
    ("norms-short", dict(norms=mx.ones((2,))), ValueError, ["EncodedVector.norms", "batch shape"]),
    ("indices-float", dict(indices=mx.ones((3, D))), ValueError, ["EncodedVector.indices", "integer"]),
    ("indices-none", dict(indices=None), ValueError, ["EncodedVector.indices", "required"]),
    ("dim-text", dict(dim="16"), ValueError, ["EncodedVector.dim", "int >= 1"]),
    ("dtype-name-int32", dict(dtype_name="int32"), ValueError, ["EncodedVector.dtype_name", "'float16'"]),
    ("quantizer-type-int", dict(quantizer_type=3), TypeError, ["EncodedVector.quantizer_type", "str"]),
]


@pytest.mark.parametrize("name", sorted(QUANT))
@pytest.mark.parametrize("label,changes,err,words", REPLACED, ids=[c[0] for c in REPLACED])
def test_replaced_encoded_vector_is_refused_naming_the_field(name, label, changes, err, words):
    ev = QUANT[name].encode(X)
    # Was "TypeError: replace() should be called on dataclass instances": the seed's EncodedVector is a dataclass.
    with pytest.raises(err) as e:
        bad = dataclasses.replace(ev, **changes)
        for call in _decodes(QUANT[name], bad):
            mx.eval(call())
    assert all(w in str(e.value) for w in words), e.value


@pytest.mark.parametrize("name", sorted(QUANT))
def test_replace_keeps_the_codes_and_slices_them(name):
    quant, ev = QUANT[name], QUANT[name].encode(X)
    same = dataclasses.replace(ev)  # the seed's unpacked view, rebuilt: decodes to the same vectors
    assert mx.array_equal(quant.decode(same), quant.decode(ev)).item()
    arrays = {f: getattr(ev, f) for f in ("indices", "norms", "signs", "residual_norm", "indices2")}
    first_two = dataclasses.replace(ev, **{f: a[:2] for f, a in arrays.items() if a is not None})
    assert mx.array_equal(quant.decode(first_two), quant.decode(ev)[:2]).item()


# (label, assignment after encode, error, words): the constructor's checks cannot see these; decode checks again
ASSIGNED = [
    ("norms-short", ("norms", mx.ones((2,))), ValueError, ["ev.norms", "batch shape"]),
    ("indices-float", ("indices", mx.ones((3, D))), ValueError, ["ev.indices", "integer"]),
    ("indices-wrong-width", ("indices", mx.zeros((3, 5), dtype=mx.uint8)), ValueError, ["indices", f"d={D}"]),
    ("dim-text", ("dim", "16"), ValueError, ["ev.dim", "int >= 1"]),
    ("dim-other", ("dim", 24), ValueError, ["dim 24", f"d={D}"]),
    ("dtype-name-int", ("dtype_name", 5), ValueError, ["ev.dtype_name", "'float32'"]),
    ("bits-9", ("bits", 9), ValueError, ["ev.bits", "0..8"]),
]


@pytest.mark.parametrize("name", sorted(QUANT))
@pytest.mark.parametrize("label,assignment,err,words", ASSIGNED, ids=[c[0] for c in ASSIGNED])
def test_assigned_encoded_vector_is_refused_at_decode_naming_the_field(name, label, assignment, err, words):
    ev = QUANT[name].encode(X)
    setattr(ev, *assignment)
    for call in _decodes(QUANT[name], ev):
        with pytest.raises(err) as e:
            mx.eval(call())
        assert all(w in str(e.value) for w in words), e.value


@pytest.mark.parametrize("name", sorted(QUANT))
@pytest.mark.parametrize("bad", [None, "codes", {"indices": mx.zeros((3, 2), dtype=mx.uint32)}])
def test_not_an_encoded_vector_is_a_type_error_naming_ev(name, bad):
    for call in _decodes(QUANT[name], bad):
        with pytest.raises(TypeError, match="ev must be an EncodedVector"):
            call()


# --- 3. estimate_inner_product: a query whose batch axes do not match the codes --------------------------------
@pytest.mark.parametrize("name", sorted(QUANT))
def test_query_batch_mismatch_names_q_and_the_expected_shape(name):
    quant = QUANT[name]
    ev = quant.encode(mx.ones((2, 5, D)))  # 2 batches of 5 keys
    with pytest.raises(ValueError) as e:  # was MLX's "[broadcast_shapes] Shapes (4) and (2) cannot be broadcast."
        quant.estimate_inner_product(mx.ones((4, 3, D)), ev)
    msg = str(e.value)
    assert "q has shape (4, 3, 16)" in msg and f"(..., m, {D})" in msg and "(2,)" in msg, msg
    for ok in ((3, D), (2, 3, D), (1, 3, D), (7, 2, 3, D), (D,)):  # what broadcasts is still scored
        assert quant.estimate_inner_product(mx.ones(ok), ev).shape[-1] == 5


@pytest.mark.parametrize("name", sorted(QUANT))
def test_query_rows_against_one_encoded_vector(name):
    quant, q = QUANT[name], mx.array(np.random.default_rng(1).standard_normal((3, D)).astype(np.float32))
    ev = quant.encode(X[0])  # batch shape (): was IndexError from swapaxes
    got = quant.estimate_inner_product(q, ev)
    assert got.shape == (3,) and mx.allclose(got, q @ quant.decode(ev), atol=1e-4).item()


# --- 4. keys near float16's maximum in the seed pages' caches ---------------------------------------------------
@pytest.mark.parametrize("kind", ["constant-6e4", "signs-6e4", "float16-max"])
def test_rvq_cache_returns_finite_keys_near_float16_max(kind):
    from veloxquant_mlx import TurboQuantRVQKVCache
    from veloxquant_mlx.compat.config import KVCacheConfig

    rng = np.random.default_rng(2)
    x = {"constant-6e4": np.full((1, 1, 4, D), 6e4), "signs-6e4": np.sign(rng.standard_normal((1, 1, 4, D))) * 6e4,
         "float16-max": np.sign(rng.standard_normal((1, 1, 4, D))) * 65504}[kind]
    keys = mx.array(x.astype(np.float16))
    cache = TurboQuantRVQKVCache(KVCacheConfig(method="turboquant_rvq", head_dim=D, bit_width_inlier=2))
    k, v = cache.update_and_fetch(keys, keys)
    # was inf: the float32 reconstruction overshoots 65504 by the quantization error and was cast as is
    assert k.dtype == mx.float16 and mx.all(mx.isfinite(k)).item() and mx.all(mx.isfinite(v)).item()
    kf, xf = k.astype(mx.float32), keys.astype(mx.float32)
    assert (mx.linalg.norm(kf - xf) / mx.linalg.norm(xf)).item() < 0.25  # 2-bit RVQ's error, not a clipped mess


@pytest.mark.parametrize("method", ["turboquant_mse", "turboquant_prod"])
def test_standalone_cache_attends_finite_near_float16_max(method):
    from veloxquant_mlx import TurboQuantKVCache
    from veloxquant_mlx.compat.config import KVCacheConfig

    x = mx.array((np.sign(np.random.default_rng(3).standard_normal((4, D))) * 65504).astype(np.float16))
    cache = TurboQuantKVCache(KVCacheConfig(method=method, head_dim=D, bit_width_inlier=3))
    cache.append_key(x)
    cache.append_value(x)
    out = cache.attend(x)  # was inf: int8 codes * the rounded-up float16 scale give 65532
    assert out.dtype == mx.float16 and mx.all(mx.isfinite(out)).item()
    assert mx.all(mx.isfinite(cache.keys())).item()


@pytest.mark.parametrize("quantizer", ["turboquant_mse", "turboquant_prod", "turboquant_rvq"])
@pytest.mark.parametrize("dtype", [mx.int8, mx.int16, mx.int32, mx.int64])
def test_decode_refuses_signed_code_indices_naming_the_field(quantizer, dtype):
    """Issue 57: signed indices decoded silently (a -1 read the codebook from its end); codes are unsigned."""
    q = QUANTIZERS[quantizer](64, 3)
    ev = q.encode(mx.random.normal((3, 64), key=mx.random.key(1)))
    codes = ev.codes(ev.bits)  # (3, 64) code indices
    with pytest.raises(TypeError, match=rf"EncodedVector\.indices must hold unsigned codes: .* got dtype {dtype}"):
        dataclasses.replace(ev, indices=codes.astype(dtype))
    ev.indices = codes.astype(dtype)  # the seed's dataclass took assignments: checked when decoded
    with pytest.raises(TypeError, match=rf"ev\.indices must hold unsigned codes: .* got dtype {dtype}"):
        q.decode(ev)
    ev.indices = codes.astype(mx.uint8)
    assert ev.indices.dtype == mx.uint8 and q.decode(ev).shape == (3, 64)
