"""`veloxquant_mlx.quant.encoded_vector`: what a quantizer stores. Packed storage with the seed's unpacked views,
the stream widths checked where they are read (naming the stream and the words it needs), every field checked by
name when built, assigned or replaced, and honest sizes (``nbytes``, ``bits_per_coordinate``)."""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.bit_pack import pack, packed_words
from veloxquant_mlx.quant.encoded_vector import EncodedVector
from veloxquant_mlx.quant.turboquant_mse import TurboQuantMSE


def _codes(shape, bits, seed=0):
    return np.random.default_rng(seed).integers(0, 2 ** bits, size=shape).astype(np.uint8)


def test_packed_streams_read_as_codes_and_signs():
    d, bits = 40, 3
    codes = _codes((2, 3, d), bits)
    signs = np.random.default_rng(1).integers(0, 2, size=(2, 3, 24)).astype(np.uint8)
    ev = EncodedVector("turboquant_prod", d, indices=pack(mx.array(codes), bits), norms=mx.ones((2, 3)),
                       signs=pack(mx.array(signs), 1), residual_norm=mx.ones((2, 3)), bits=bits, n_signs=24)
    assert ev.batch_shape == (2, 3) and ev.batch_size == 6
    assert ev.arrays()["indices"].shape == (2, 3, packed_words(d, bits))
    np.testing.assert_array_equal(np.array(ev.codes(bits)), codes)
    np.testing.assert_array_equal(np.array(ev.indices), codes)  # the seed's view
    np.testing.assert_array_equal(np.array(ev.sign_values(24)), signs * 2.0 - 1.0)
    np.testing.assert_array_equal(np.array(ev.signs), (signs * 2 - 1).astype(np.int8))
    assert ev.codes(0).shape == (2, 3, d) and not np.any(np.array(ev.codes(0)))  # no index stream (Prod, b = 1)
    with pytest.raises(ValueError, match=r"EncodedVector.indices holds 4 words per vector; d=40 at bits=4 needs 5"):
        ev.codes(4)
    with pytest.raises(ValueError, match=r"EncodedVector.signs holds 1 words per vector; m=40 signs need 2"):
        ev.sign_values(40)
    with pytest.raises(ValueError, match=r"EncodedVector.indices2 is missing \(quantizer_type='turboquant_prod'\)"):
        ev.codes(bits, "indices2")


def test_unpacked_streams_and_missing_norms():
    codes = _codes((5, 8), 2)
    ev = EncodedVector("turboquant_mse", 8, indices=codes)  # numpy is taken as an mx.array
    assert isinstance(ev.arrays()["indices"], mx.array) and ev.norms is None and ev.batch_shape == (5,)
    assert ev.norm_values().tolist() == [1.0] * 5  # the seed's unit vectors
    np.testing.assert_array_equal(np.array(ev.codes(2)), codes)
    ev2 = EncodedVector("turboquant_mse", 8, indices=pack(mx.array(codes), 2))
    with pytest.raises(ValueError, match="stored packed and this EncodedVector was built without bits="):
        ev2.indices


def test_every_field_is_checked_by_name():
    idx = mx.zeros((4, 2), dtype=mx.uint32)
    for kwargs, match in [
        (dict(dim=0), r"EncodedVector.dim must be an int >= 1, got 0"),
        (dict(dtype_name="int8"), r"EncodedVector.dtype_name must name an MLX float dtype"),
        (dict(bits=9), r"EncodedVector.bits must be an int in 0..8 or None, got 9"),
        (dict(n_signs=0), r"EncodedVector.n_signs must be an int >= 1 or None, got 0"),
        (dict(norms=mx.ones((3,))), r"EncodedVector.indices has batch shape \(4,\) but EncodedVector.norms has \(3,\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            EncodedVector("turboquant_mse", **{"dim": 8, "indices": idx, **kwargs})
    with pytest.raises(TypeError, match="EncodedVector.quantizer_type must be a str, got int"):
        EncodedVector(3, 8, indices=idx)
    with pytest.raises(TypeError, match="EncodedVector.norms must be an mx.array, a numpy array or None, got list"):
        EncodedVector("turboquant_mse", 8, indices=idx, norms=[1.0] * 4)


def test_assigned_and_replaced_fields_are_checked_before_decode():
    q = TurboQuantMSE(16, 3)
    x = mx.array(np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32))
    ev = q.encode(x)
    ref = np.array(q.decode(ev))
    same = dataclasses.replace(ev, norms=ev.norms)  # through the checking constructor, seed's view of the codes
    np.testing.assert_array_equal(np.array(q.decode(same)), ref)
    ev.norms = mx.ones((3,))
    with pytest.raises(ValueError, match=r"ev.indices has batch shape \(4,\) but ev.norms has \(3,\)"):
        q.decode(ev)
    ev.norms = None  # deleting a field is allowed: the seed's unit norms
    assert q.decode(ev).shape == (4, 16)
    with pytest.raises(ValueError, match="ev.indices is required"):
        ev.indices = None
        q.decode(ev)


def test_sizes_count_what_is_stored():
    q = TurboQuantMSE(64, 3, norm_dtype="float32")
    ev = q.encode(mx.ones((10, 64)))
    assert ev.nbytes == 10 * (packed_words(64, 3) * 4 + 4)
    assert ev.bits_per_coordinate == pytest.approx(8 * ev.nbytes / (10 * 64))
    assert "EncodedVector('turboquant_mse', dim=64, indices=(10, 6), norms=(10,))" == repr(ev)
