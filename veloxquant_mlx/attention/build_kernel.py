"""Builds the compiled attention on codes (``csrc/coded_attention.cpp``, with the codecs' affine encoding and the
batch caches' row gather in the same module) against the installed MLX.

Run by ``pip install -e .`` / ``scripts/setup.sh`` (setup.py's build_ext) and by hand::

    python -m veloxquant_mlx.attention.build_kernel [--verbose]

Needs CMake (>= 3.20), a C++20 compiler and nanobind at the version the installed MLX was built with (its Python
binding and ours must share nanobind's ABI: MLX 0.32 is built with nanobind 3.1.0; another version builds but
its module cannot take ``mlx.core.array``). The module lands beside this file (``_coded_attention*.so``) and
records the MLX version it was built against; `veloxquant_mlx.attention.kernel` refuses it under another one.

Instruction sets (`arch_flags`): on x86-64 ``-mavx2 -mfma -mf16c`` (any x86-64 CPU with AVX2, FMA and F16C runs
the binary; a wheel built on one machine must not die with an illegal instruction on another, as
``-march=native`` could); none on arm64 (NEON is baseline). The module records them and reports which of them the
running CPU lacks; the loader refuses it then (the pure-MLX reference runs, one warning). ``VELOXQUANT_ARCH_FLAGS``
(space-separated) replaces them, e.g. ``-march=native`` for a build that only ever runs where it was built.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import mlx
import mlx.core as mx

HERE = Path(__file__).resolve().parent
SOURCE_DIR = HERE / "csrc"


def _sources_module():
    """``_sources.py`` beside this file, loaded by path (setup.py loads this file the same way, before the package
    can be imported)."""
    spec = importlib.util.spec_from_file_location("_vq_kernel_sources", HERE / "_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


source_hash = _sources_module().source_hash

# MLX minor version -> the nanobind release its Python module was built with (a mismatch breaks the array type).
NANOBIND_FOR_MLX = {"0.32": "3.1.0"}


class KernelBuildError(RuntimeError):
    """The compiled kernel could not be built (the reason is in the message)."""


def required_nanobind(mlx_version: str) -> Optional[str]:
    return NANOBIND_FOR_MLX.get(".".join(mlx_version.split(".")[:2]))


# x86-64 extensions the kernel's vector code is written for (coded_attention.cpp's AVX2 / FMA / F16C paths).
X86_FLAGS = ("-mavx2", "-mfma", "-mf16c")


def arch_flags(machine: Optional[str] = None) -> List[str]:
    """The compiler's instruction-set flags for ``machine`` (default: this one; env ``VELOXQUANT_ARCH_FLAGS``
    replaces them): AVX2 / FMA / F16C on x86-64, none elsewhere."""
    override = os.environ.get("VELOXQUANT_ARCH_FLAGS")
    if override is not None:
        return override.split()
    machine = (machine or platform.machine()).lower()
    return list(X86_FLAGS) if machine in ("x86_64", "amd64", "x64") else []


def _check_tools() -> tuple:
    try:
        import nanobind  # a build-time dependency only (pyproject's build-system, scripts/setup.sh)
    except ImportError as e:
        raise KernelBuildError(f"building the kernel needs nanobind installed ({e})") from None
    want = required_nanobind(mx.__version__)
    if want is not None and nanobind.__version__ != want:
        raise KernelBuildError(f"MLX {mx.__version__} is built with nanobind {want}; nanobind "
                               f"{nanobind.__version__} is installed (pip install nanobind=={want})")
    cmake = shutil.which("cmake")
    if cmake is None:
        raise KernelBuildError("cmake is not installed (pip install cmake, or the system's package)")
    return mx.__version__, Path(mlx.__path__[0]), Path(nanobind.cmake_dir()), cmake


def build(out_dir: Optional[Path] = None, build_dir: Optional[Path] = None, verbose: bool = False) -> Path:
    """Configure and build the module into ``out_dir`` (default: this package); returns its path.

    Raises KernelBuildError with the reason (missing tool, wrong nanobind, compiler error with its output)."""
    mlx_version, mlx_dir, nb_dir, cmake = _check_tools()
    out_dir = Path(out_dir or HERE).resolve()
    build_dir = Path(build_dir or (HERE.parent.parent / "build" / f"kernel-py{sys.version_info[0]}{sys.version_info[1]}"))
    build_dir.mkdir(parents=True, exist_ok=True)
    arch = arch_flags()
    # (said before the compiler runs: a failure below then names the MLX it was building against too)
    print(f"veloxquant kernel: building against MLX {mlx_version} ({mlx_dir}), flags {' '.join(arch) or '(none)'}",
          file=sys.stderr, flush=True)
    configure = [cmake, "-S", str(SOURCE_DIR), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_ROOT={nb_dir}",
                 f"-DMLX_ROOT={mlx_dir / 'share' / 'cmake' / 'MLX'}", f"-DMLX_LIB_DIR={mlx_dir / 'lib'}",
                 f"-DVELOXQUANT_OUT_DIR={out_dir}", f"-DVELOXQUANT_ARCH_FLAGS={';'.join(arch)}",
                 f"-DVELOXQUANT_SOURCE_HASH={source_hash() or 'unknown'}"]
    jobs = str(max(os.cpu_count() or 1, 1))
    for cmd in (configure, [cmake, "--build", str(build_dir), "--config", "Release", "-j", jobs]):
        run = subprocess.run(cmd, capture_output=not verbose, text=True)
        if run.returncode:
            tail = "" if verbose else (run.stdout + run.stderr)[-3000:]
            raise KernelBuildError(f"{' '.join(cmd[:3])} ... failed (exit {run.returncode}) building against MLX "
                                   f"{mlx_version}:\n{tail}")
    built = sorted(out_dir.glob("_coded_attention*.so")) + sorted(out_dir.glob("_coded_attention*.pyd"))
    if not built:
        raise KernelBuildError(f"the build finished but left no _coded_attention module in {out_dir}")
    return built[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verbose", action="store_true", help="show CMake's and the compiler's output")
    args = ap.parse_args(argv)
    try:
        path = build(verbose=args.verbose)
    except KernelBuildError as e:
        print(f"veloxquant kernel: not built: {e}", file=sys.stderr)
        return 1
    print(f"veloxquant kernel: built {path} against MLX {mx.__version__} ({Path(mlx.__path__[0])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
