"""Helpers, fixtures and constants shared by `test_kernel.py` and `test_kernel_fallback.py`."""
from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.attention import kernel, packed_sdpa
from veloxquant_mlx.attention.packed_sdpa import CodedPart, ExactPart, attend_one_query, reference_one_query
from veloxquant_mlx.codecs import CODECS
from veloxquant_mlx.cache.options import CacheOptions

# layouts the kernel reads: keys and values both offer affine_codes
KERNEL_LAYOUTS = [name for name, lay in CODECS.items()
                  if hasattr(lay.keys, "affine_codes") and hasattr(lay.values, "affine_codes")]


def _parts(codec: str, bits: int, n: int, *, B=1, H=2, R=3, d=64, exact=True, seed=0, group_size=None,
           scale_dtype=None, v_bits=None, **options):
    o = CacheOptions(codec=codec, k_bits=bits, v_bits=v_bits or bits, group_size=group_size, **options).layer_options()
    kc, vc = CODECS[codec].make(o, d, d)
    if scale_dtype is not None:
        for c in (kc, vc):
            c.scale_dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16}[scale_dtype]
    keys = [mx.random.normal((B, H, n, d), key=mx.random.key(seed + i)) for i in range(2)]
    k, v = keys[0] * 1.5 + 0.7, keys[1]
    kc.fit(k)
    vc.fit(v)
    parts = [CodedPart(kc, kc.encode(k), vc, vc.encode(v))]
    if exact:
        e = [mx.random.normal((B, H, m, d), key=mx.random.key(seed + 10 + m)) for m in (4, 7)]
        parts = [ExactPart(e[0], e[0] * 0.5)] + parts + [ExactPart(e[1], -e[1])]
    q = mx.random.normal((B, H * R, 1, d), key=mx.random.key(seed + 99)) * 2
    return q, parts


def _close(out, ref, tol=1e-5):
    out, ref = np.array(out), np.array(ref)
    assert out.shape == ref.shape
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


def _kernel(q, parts, scale=0.125, sinks=None, masks=None):
    out = kernel.decode_step(q, parts, scale, sinks, masks)
    assert out is not None, "the kernel declined a case it reads"
    return out


CASES = [(c, b) for c in KERNEL_LAYOUTS for b in (2, 3, 4, 8) if b in CODECS[c].keys.BITS and b in CODECS[c].values.BITS
         and not (c in ("lloyd_max", "kblock_vlloyd") and b == 8)]  # (8-bit Lloyd-Max: a 256-level codebook, slow fit)


def _reference_chunk(q, parts, scale, sinks=None):
    previous = kernel.set_enabled(False)
    try:
        return packed_sdpa.packed_attention(q, parts, scale, "causal", sinks=sinks)
    finally:
        kernel.set_enabled(previous)


# -- the fallback -------------------------------------------------------------------------------------------------
@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """The module's load state, restored afterwards."""
    for name in ("_module", "_reason", "_warned"):
        monkeypatch.setattr(kernel, name, getattr(kernel, name))
    monkeypatch.setattr(kernel, "_refusals", {})  # (each kind of refusal warns once: a fresh count per test)
    yield


def _falls_back_with_one_warning(monkeypatch, match: str) -> None:
    """With the kernel module reloaded, a step runs on the reference with one warning matching ``match`` (not one
    per step), and gives the reference's output."""
    monkeypatch.setattr(kernel, "_module", None)
    monkeypatch.setattr(kernel, "_reason", None)
    monkeypatch.setattr(kernel, "_warned", False)
    q, parts = _parts("affine_block", 8, 128)
    with pytest.warns(RuntimeWarning, match=match):
        out = attend_one_query(q, parts, 0.125)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, not one per step
        attend_one_query(q, parts, 0.125)
    assert mx.array_equal(out, reference_one_query(q, parts, 0.125))


def _load_fake(monkeypatch, **functions) -> str:
    """Loads a stand-in extension module (built for this MLX) holding ``functions``; returns why it was refused."""
    import sys
    import types

    from veloxquant_mlx.attention._sources import source_hash

    fake = types.ModuleType("veloxquant_mlx.attention._coded_attention")
    fake.built_with_mlx = mx.__version__
    fake.built_from_sources = source_hash()
    for name, fn in functions.items():
        setattr(fake, name, fn)
    monkeypatch.setitem(sys.modules, "veloxquant_mlx.attention._coded_attention", fake)
    monkeypatch.setattr(kernel, "_module", None)
    monkeypatch.setattr(kernel, "_reason", None)
    monkeypatch.setattr(kernel, "_warned", True)
    assert kernel._load() is None
    return kernel._reason


def _fresh(parts):
    """New part objects over copied arrays (of a `Rows.copy`, which keeps no view): nothing a step kept applies."""
    return [CodedPart(p.k_codec, {f: mx.array(a) for f, a in p.k_arrays.items()}, p.v_codec,
                      {f: mx.array(a) for f, a in p.v_arrays.items()}) if isinstance(p, CodedPart) else
            ExactPart(mx.array(p.keys), mx.array(p.values)) for p in parts]
