"""What a built kernel module must pass before it is used: the CPU features it was built for, and a first-use check.

The flags the module file records (read without importing it: its static initializers are compiled with them too),
this CPU's features, the message when they do not match, and one small problem through the module against the
same math in plain MLX ops (its attention, encoding and row gather). No state here: the state these checks decide
(the loaded module, why it is refused) and the loading itself live in :mod:`veloxquant_mlx.attention.kernel`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import mlx.core as mx

from veloxquant_mlx.codecs.affine_encode import reference_affine_encode
from veloxquant_mlx.codecs.affine_sym_log import reference_sym_log_encode
from veloxquant_mlx.codecs.token_lloyd import gaussian_levels, reference_level_log_encode


def _smoke_check(mod) -> None:
    """One small problem through the kernel against the same math in plain MLX ops (catches an ABI or build
    mismatch that imports fine but computes garbage)."""
    key = mx.random.key(7)
    k1, k2, k3 = mx.random.split(key, 3)
    q = mx.random.normal((1, 2, 2, 32), key=k1)
    k = mx.random.normal((1, 2, 64, 32), key=k2)
    v = mx.random.normal((1, 2, 64, 32), key=k3)
    kw, ks, kb = mx.quantize(mx.swapaxes(k, -1, -2), group_size=32, bits=8)  # keys: tokens last
    vw, vs, vb = mx.quantize(v, group_size=32, bits=4)  # values: tokens first
    kd = mx.swapaxes(mx.dequantize(kw, ks, kb, group_size=32, bits=8), -1, -2)
    vd = mx.dequantize(vw, vs, vb, group_size=32, bits=4)
    ref = mx.softmax((q @ mx.swapaxes(kd, -1, -2)) * 0.6931471805599453, axis=-1, precise=True) @ vd
    eye = mx.eye(32)
    empty = mx.zeros((1, 2, 0, 32))
    out = mod.coded_decode_attention(q, eye, eye, kw, ks, kb, True, 8, 32, vw, vs, vb, False, 4, 32, 0.0,
                                     empty, empty, None, None, None, None, None)
    err = mx.max(mx.abs(out - ref)).item()
    if not err < 1e-4:
        raise RuntimeError(f"the kernel's check against plain MLX failed (max error {err:.3g})")
    if hasattr(mod, "affine_encode"):  # the codecs' compiled encoding: bit for bit mx.quantize's codes
        for tokens_last in (False, True):
            got = mod.affine_encode(k, None, 4, 32, tokens_last, True)
            want = reference_affine_encode(k, 4, 32, mx.float16, tokens_last)
            if not all(mx.array_equal(a, b).item() for a, b in zip(got, want)):
                raise RuntimeError(f"the compiled encoding's check against mx.quantize failed "
                                   f"(tokens_last={tokens_last})")
    if hasattr(mod, "sym_log_encode"):  # the symmetric log-scale encoding: bit for bit the codecs' operations
        got = mod.sym_log_encode(k, 4, 32)
        if not all(mx.array_equal(a, b).item() for a, b in zip(got, reference_sym_log_encode(k, 4, 32))):
            raise RuntimeError("the compiled symmetric encoding's check against the codecs' operations failed")
    if hasattr(mod, "level_log_encode"):  # the Lloyd-Max log-scale encoding: bit for bit the codecs' operations
        levels, inner = gaussian_levels(4)
        got = mod.level_log_encode(k, levels, inner, 4, 32)
        if not all(mx.array_equal(a, b).item() for a, b in zip(got, reference_level_log_encode(k, levels, inner, 4, 32))):
            raise RuntimeError("the compiled Lloyd-Max encoding's check against the codecs' operations failed")
    if hasattr(mod, "gather_rows"):  # the batch caches' row gather: mx.take's rows
        rows = mx.swapaxes(k.reshape(2, 64, 32), 1, 2)  # (a strided view)
        got = mod.gather_rows([rows], [1, 0], [1])[0]
        if not mx.array_equal(got, mx.take(rows, mx.array([1, 0]), axis=0)).item():
            raise RuntimeError("the compiled row gather's check against mx.take failed")


# compiler flag -> the CPU feature it needs, as /proc/cpuinfo names it (build_kernel.X86_FLAGS and a few more)
FLAG_FEATURES = {"-mavx": "avx", "-mavx2": "avx2", "-mfma": "fma", "-mf16c": "f16c", "-mbmi2": "bmi2",
                 "-mavx512f": "avx512f", "-mavx512bw": "avx512bw", "-mavx512vl": "avx512vl"}


def _cpu_flags() -> Optional[set]:
    """This CPU's feature flags from /proc/cpuinfo (Linux), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def _binary_flags(path: str) -> Optional[List[str]]:
    """The instruction-set flags recorded in the module file at ``path`` (its ``VELOXQUANT_ARCH_FLAGS=`` marker),
    read without importing it; None when it has no marker (a module built before it existed)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    at = data.find(b"VELOXQUANT_ARCH_FLAGS=")
    if at < 0:
        return None
    end = data.find(b"\0", at)
    return data[at + len(b"VELOXQUANT_ARCH_FLAGS="):end].decode("ascii", "replace").split()


def _cpu_refusal(missing: Sequence[str]) -> str:
    return (f"this CPU lacks {', '.join(missing)}, which the compiled kernel was built for (the default x86-64 build "
            "needs AVX2, FMA and F16C); a build for this CPU without them: VELOXQUANT_ARCH_FLAGS=' ' "
            "python -m veloxquant_mlx.attention.build_kernel")
