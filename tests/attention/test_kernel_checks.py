"""The checks a built kernel module must pass (veloxquant_mlx.attention.kernel_checks): the instruction-set flags
recorded in its file, this CPU's features, the refusal message, and the first-use computation against plain MLX.
How the loader acts on them (one warning, the reference runs): tests/attention/test_kernel_fallback.py."""
from __future__ import annotations

import types

import mlx.core as mx
import pytest

from veloxquant_mlx.attention import kernel, kernel_checks


def test_binary_flags_are_read_from_the_marker_without_importing(tmp_path):
    built = tmp_path / "mod.so"
    built.write_bytes(b"\x7fELF junk\0VELOXQUANT_ARCH_FLAGS=-mavx2 -mfma -mf16c\0more junk")
    assert kernel_checks._binary_flags(str(built)) == ["-mavx2", "-mfma", "-mf16c"]
    empty = tmp_path / "arm.so"
    empty.write_bytes(b"junk\0VELOXQUANT_ARCH_FLAGS=\0")
    assert kernel_checks._binary_flags(str(empty)) == []  # (an arm64 build: no flags)
    old = tmp_path / "old.so"
    old.write_bytes(b"a module built before the marker existed")
    assert kernel_checks._binary_flags(str(old)) is None
    assert kernel_checks._binary_flags(str(tmp_path / "missing.so")) is None


def test_the_built_module_records_what_it_was_built_with():
    import importlib.util

    recorded = kernel_checks._binary_flags(importlib.util.find_spec(kernel.MODULE).origin)
    assert recorded == kernel.compiled_module().built_with_flags.split()


def test_cpu_flags_come_from_cpuinfo(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: test\nflags\t\t: fpu sse2 avx avx2 fma\n\nflags\t: other\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path,
                                                                          *a, **k))
    assert kernel_checks._cpu_flags() == {"fpu", "sse2", "avx", "avx2", "fma"}  # the first flags line
    cpuinfo.write_text("processor\t: 0\n")
    assert kernel_checks._cpu_flags() is None  # no flags line (e.g. arm64's "Features")

    def unreadable(path, *a, **k):
        raise OSError("no /proc here")

    monkeypatch.setattr("builtins.open", unreadable)
    assert kernel_checks._cpu_flags() is None


def test_every_x86_build_flag_maps_to_the_feature_cpuinfo_names():
    from veloxquant_mlx.attention.build_kernel import X86_FLAGS

    assert [kernel_checks.FLAG_FEATURES[f] for f in X86_FLAGS] == ["avx2", "fma", "f16c"]


def test_the_refusal_names_what_is_missing_and_how_to_build_without_it():
    message = kernel_checks._cpu_refusal(["avx2", "f16c"])
    assert "this CPU lacks avx2, f16c" in message
    assert "VELOXQUANT_ARCH_FLAGS=' ' python -m veloxquant_mlx.attention.build_kernel" in message


def test_the_smoke_check_passes_the_built_module():
    kernel_checks._smoke_check(kernel.compiled_module())  # raises on any mismatch


def _stand_in(real, **replaced):
    """A module with the real module's functions, some of them replaced."""
    mod = types.SimpleNamespace(coded_decode_attention=real.coded_decode_attention, affine_encode=real.affine_encode,
                                gather_rows=real.gather_rows)
    for name, fn in replaced.items():
        setattr(mod, name, fn)
    return mod


def test_the_smoke_check_catches_each_wrong_function():
    real = kernel.compiled_module()
    attend = real.coded_decode_attention
    with pytest.raises(RuntimeError, match="against plain MLX failed"):
        kernel_checks._smoke_check(_stand_in(real, coded_decode_attention=lambda *a, **k: attend(*a, **k) + 1e-3))
    with pytest.raises(RuntimeError, match="against plain MLX failed"):  # (NaN is not "within 1e-4")
        kernel_checks._smoke_check(_stand_in(real, coded_decode_attention=lambda *a, **k: attend(*a, **k) * mx.nan))

    def wrong_scales(y, offset, bits, group, tokens_last, half):
        w, s, b = real.affine_encode(y, offset, bits, group, tokens_last, half)
        return w, s * 2, b

    with pytest.raises(RuntimeError, match="encoding's check .* failed \\(tokens_last=False\\)"):
        kernel_checks._smoke_check(_stand_in(real, affine_encode=wrong_scales))
    with pytest.raises(RuntimeError, match="row gather's check against mx.take failed"):
        kernel_checks._smoke_check(_stand_in(real, gather_rows=lambda arrays, rows, folds: [a for a in arrays]))


def test_a_module_without_the_optional_functions_is_checked_on_attention_alone():
    """A module built before the encoding and the gather existed: only its attention is checked."""
    attention_only = types.SimpleNamespace(coded_decode_attention=kernel.compiled_module().coded_decode_attention)
    kernel_checks._smoke_check(attention_only)
