"""Building the compiled kernel (veloxquant_mlx.attention.build_kernel): the instruction-set flags (portable by
default, recorded in the module), the nanobind version MLX needs, and the errors that name a missing tool, all without
running a compiler."""
from __future__ import annotations

import sys
import types

import mlx.core as mx
import pytest

from veloxquant_mlx.attention import _sources, build_kernel, kernel


def test_the_build_flags_run_on_any_avx2_x86_64_and_are_recorded(monkeypatch):
    """No -march=native: AVX2 / FMA / F16C on x86-64, nothing on arm64; the module carries the flags it was built
    with, readable from its file before it is imported."""
    import importlib.util

    from veloxquant_mlx.attention import build_kernel
    monkeypatch.delenv("VELOXQUANT_ARCH_FLAGS", raising=False)
    assert build_kernel.arch_flags("x86_64") == build_kernel.arch_flags("AMD64") == ["-mavx2", "-mfma", "-mf16c"]
    assert build_kernel.arch_flags("arm64") == build_kernel.arch_flags("aarch64") == []
    monkeypatch.setenv("VELOXQUANT_ARCH_FLAGS", "-march=native -O2")
    assert build_kernel.arch_flags("x86_64") == ["-march=native", "-O2"]
    mod = kernel.compiled_module()
    recorded = kernel._binary_flags(importlib.util.find_spec(kernel.MODULE).origin)
    assert recorded == mod.built_with_flags.split()
    assert "-march=native" not in recorded  # (CI and setup.sh build with the defaults)
    assert list(mod.missing_cpu_features()) == []  # this CPU runs it (it just did)


def test_the_nanobind_release_follows_mlx_minor_version():
    assert build_kernel.required_nanobind("0.32.4") == build_kernel.required_nanobind("0.32.0") == "3.1.0"
    assert build_kernel.required_nanobind("0.99.1") is None  # (an MLX not in the table: not checked)


def _fake_nanobind(monkeypatch, version: str) -> None:
    fake = types.ModuleType("nanobind")
    fake.__version__ = version
    fake.cmake_dir = lambda: "/nowhere/nanobind/cmake"
    monkeypatch.setitem(sys.modules, "nanobind", fake)


def test_a_wrong_nanobind_is_named_with_the_version_to_install(monkeypatch):
    want = build_kernel.required_nanobind(mx.__version__)
    if want is None:
        pytest.skip(f"MLX {mx.__version__} has no nanobind pin in NANOBIND_FOR_MLX")
    _fake_nanobind(monkeypatch, "0.0.1")
    with pytest.raises(build_kernel.KernelBuildError, match=f"nanobind {want}; nanobind 0.0.1 is installed"):
        build_kernel.build()
    with pytest.raises(build_kernel.KernelBuildError, match=f"pip install nanobind=={want}"):
        build_kernel._check_tools()


def test_missing_nanobind_or_cmake_is_a_build_error_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "nanobind", None)  # (an import of it raises ImportError)
    with pytest.raises(build_kernel.KernelBuildError, match="needs nanobind installed"):
        build_kernel._check_tools()
    _fake_nanobind(monkeypatch, build_kernel.required_nanobind(mx.__version__) or "3.1.0")
    monkeypatch.setattr(build_kernel.shutil, "which", lambda name: None)
    with pytest.raises(build_kernel.KernelBuildError, match="cmake is not installed"):
        build_kernel.build()


def test_main_reports_a_failed_build_and_exits_1(monkeypatch, capsys):
    def fail(**kwargs):
        raise build_kernel.KernelBuildError("no compiler here")

    monkeypatch.setattr(build_kernel, "build", fail)
    assert build_kernel.main([]) == 1
    assert "veloxquant kernel: not built: no compiler here" in capsys.readouterr().err


def test_the_build_records_the_digest_the_loader_checks():
    """The digest compiled into the module (build_kernel loads _sources.py by path) is the one the loader compares."""
    assert build_kernel.source_hash() == _sources.source_hash() is not None
    assert build_kernel.SOURCE_DIR == _sources.SOURCE_DIR
