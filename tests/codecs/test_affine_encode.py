"""The compiled affine encoding (`csrc/affine_encode.cpp`) against its MLX reference, bit for bit.

`veloxquant_mlx.codecs.affine_encode.reference_affine_encode` is the reference (``mx.quantize``, the block keys'
NaN bias for a non-finite group and rotated-mean offset, the float16 clamp). The compiled operation must give
the same three arrays exactly, for every width and group MLX packs, both layouts, both stored scale dtypes, head
dims that are and are not a multiple of its eight SIMD lanes, magnitudes from tiny to beyond float16, and
non-finite inputs; the codecs must store the same codes whichever path runs, and take the compiled one when
the kernel is on (its first-use check against a wrong encoding: tests/attention/test_kernel.py). CI builds the kernel,
so the compiled path is what these tests reach.
"""
from __future__ import annotations

import mlx.core as mx
import pytest

from veloxquant_mlx.attention import kernel
from veloxquant_mlx.codecs import affine_encode as encoding
from veloxquant_mlx.codecs.affine_encode import affine_encode, reference_affine_encode
from veloxquant_mlx.codecs.affine import AffineRotatedCodec
from veloxquant_mlx.codecs.affine_block import AffineBlockKeyCodec
from veloxquant_mlx.codecs.affine_block_kv import AffineBlockKVCodec, AffineBlockKVMSECodec


@pytest.fixture(autouse=True)
def compiled_provider(monkeypatch):
    """The compiled encoder handed to the codecs as the cache layer hands it (cache/row_codes.py), whatever this
    process imported before."""
    monkeypatch.setattr(encoding, "_compiled_provider", kernel.compiled_encoder)


@pytest.fixture(scope="module")
def mod():
    m = kernel.compiled_module()
    assert m is not None and hasattr(m, "affine_encode"), kernel.status()[1]
    return m


def _same(got, want):
    return [bool(mx.array_equal(a, b, equal_nan=True).item()) and a.dtype == b.dtype and a.shape == b.shape
            for a, b in zip(got, want)]


def _inputs(shape, scale, seed, tokens_last):
    y = mx.random.normal(shape, key=mx.random.key(seed)) * scale + 0.3 * scale
    off = mx.random.normal((shape[1], shape[3]), key=mx.random.key(seed + 1)) if tokens_last else None
    return y, off


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("tokens_last", [False, True])
def test_bit_for_bit_every_width_group_and_layout(mod, bits, group, tokens_last):
    for half in (True, False):
        for i, scale in enumerate((1.0, 3e-4, 5e3)):
            y, off = _inputs((2, 3, 128, 128), scale, 10 * bits + i, tokens_last)
            got = mod.affine_encode(y, off, bits, group, tokens_last, half)
            want = reference_affine_encode(y, bits, group, mx.float16 if half else mx.float32, tokens_last, off)
            assert all(_same(got, want)), (half, scale, _same(got, want))


@pytest.mark.parametrize("d", [32, 36, 80])
def test_channels_beyond_the_simd_lanes_and_no_offset(mod, d):
    """Keys per channel with a head dim that leaves a remainder of the eight lanes (36: the scalar path too)."""
    for off_given in (True, False):
        y, off = _inputs((1, 2, 64, d), 2.0, d, True)
        off = off if off_given else None
        got = mod.affine_encode(y, off, 4, 64, True, True)
        assert all(_same(got, reference_affine_encode(y, 4, 64, mx.float16, True, off)))


@pytest.mark.parametrize("tokens_last", [False, True])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 7e4, -3e38, 0.0, -0.0])
def test_non_finite_extreme_and_signed_zero_inputs(mod, tokens_last, value):
    """Groups holding inf, NaN, values beyond float16, or only (signed) zeros: the same scales and biases (NaN where
    the reference has NaN) and codes as the reference."""
    for frac in (0.02, 1.0):
        y, off = _inputs((1, 3, 64, 64), 1.0, 7, tokens_last)
        hit = mx.random.uniform(shape=y.shape, key=mx.random.key(3)) < frac
        y = mx.where(hit, mx.array(value, dtype=mx.float32), y)
        got = mod.affine_encode(y, off, 4, 64, tokens_last, True)
        assert all(_same(got, reference_affine_encode(y, 4, 64, mx.float16, tokens_last, off))), frac


@pytest.mark.parametrize("tokens_last", [False, True])
def test_strided_and_lazy_inputs(mod, tokens_last):
    """A transposed view, a slice of a longer array, and an unevaluated offset: copied or read as they are, the
    same arrays."""
    base = mx.random.normal((1, 3, 64, 256), key=mx.random.key(11))
    off = mx.random.normal((3, 64), key=mx.random.key(12)) * 2 if tokens_last else None
    for y in (mx.swapaxes(base[..., :64], -1, -2) * 1.0, base[:, :, :, 64:128], mx.swapaxes(base[..., :64], -1, -2)):
        got = mod.affine_encode(y, off, 8, 64, tokens_last, True)
        assert all(_same(got, reference_affine_encode(y, 8, 64, mx.float16, tokens_last, off)))


def test_bad_arguments_are_refused_with_a_clear_error(mod):
    y = mx.zeros((1, 2, 64, 64))
    for args, match in [((y.astype(mx.float16), None, 4, 64, False, True), "float32"),
                        ((y[0], None, 4, 64, False, True), r"\(B, H, T, d\)"),
                        ((y, None, 7, 64, False, True), "bits"),
                        ((y, None, 4, 48, False, True), "group"),
                        ((y[:, :, :40], None, 4, 32, True, True), "whole groups"),
                        ((y, mx.zeros((3, 64)), 4, 64, True, True), "offset"),
                        ((y, mx.zeros((2, 64)), 4, 64, False, True), "offset")]:
        with pytest.raises(ValueError, match=match):
            mod.affine_encode(*args)


CODECS = [(AffineRotatedCodec, 4, {}), (AffineRotatedCodec, 8, {"center": False}),
          (AffineRotatedCodec, 3, {"scale_dtype": "float32"}), (AffineBlockKeyCodec, 8, {}),
          (AffineBlockKeyCodec, 2, {"center": False}), (AffineBlockKVCodec, 4, {"block": 128}),
          (AffineBlockKVMSECodec, 3, {}), (AffineRotatedCodec, 4, {"scale_dtype": "bfloat16"})]


@pytest.mark.parametrize("cls,bits,kw", CODECS)
def test_codecs_store_the_same_codes_on_either_path(cls, bits, kw):
    x = mx.random.normal((2, 3, 128, 64), key=mx.random.key(bits)) * 2 + 0.5
    c = cls(64, bits, **kw)
    c.fit(x)
    on = c.encode(x)
    previous = kernel.set_enabled(False)
    try:
        off = c.encode(x)
    finally:
        kernel.set_enabled(previous)
    assert set(on) == set(off)
    assert all(_same([on[f] for f in on], [off[f] for f in on]))


def test_codecs_take_the_compiled_path_where_it_applies(monkeypatch):
    """Plain affine grids go through the compiled operation; the clipped grid of the MSE codec, bfloat16 scales
    and a kernel turned off do not."""
    real = kernel.compiled_module()
    calls = []

    class Spy:
        def affine_encode(self, *args):
            calls.append(args[2:])
            return real.affine_encode(*args)

    monkeypatch.setattr(kernel, "compiled_module", lambda: Spy() if kernel.enabled() else None)
    assert encoding._compiled_provider is kernel.compiled_encoder
    x = mx.random.normal((1, 2, 64, 64), key=mx.random.key(0))
    for cls, kw, taken in [(AffineRotatedCodec, {}, (4, 64, False, True)), (AffineBlockKeyCodec, {}, (4, 64, True, True)),
                           (AffineBlockKVMSECodec, {}, None), (AffineRotatedCodec, {"scale_dtype": "bfloat16"}, None)]:
        calls.clear()
        c = cls(64, 4, **kw)
        c.fit(x)
        mx.eval(c.encode(x))
        assert calls == ([taken] if taken else []), cls.__name__
    previous = kernel.set_enabled(False)
    try:
        calls.clear()
        mx.eval(AffineBlockKeyCodec(64, 4).encode(x))
        assert calls == []
    finally:
        kernel.set_enabled(previous)


def test_the_wrapper_falls_back_to_the_reference_when_the_module_lacks_the_operation(monkeypatch):
    """A kernel built before the encoding existed (no ``affine_encode``): the reference runs, the same arrays."""
    monkeypatch.setattr(kernel, "compiled_module", lambda: object())
    y, off = _inputs((1, 2, 64, 64), 1.0, 5, True)
    got = affine_encode(y, 8, 64, mx.float16, True, off)
    assert all(_same(got, reference_affine_encode(y, 8, 64, mx.float16, True, off)))
