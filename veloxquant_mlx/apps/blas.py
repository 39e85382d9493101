"""Prefer Debian's OpenBLAS for MLX's CPU build (float32 matmul ~50x faster, same results).

MLX links whatever ``libblas.so.3`` resolves to, which on a bare Debian is the slow reference
BLAS. The library can only be swapped before the process maps it, so :func:`ensure_openblas`
re-executes the current command with ``LD_PRELOAD`` set; call it before ``import mlx``.
"""
from __future__ import annotations

import ctypes
import glob
import os
import platform
import sys
from typing import List, Optional

OPT_OUT_ENV = "VELOXQUANT_NO_OPENBLAS"
# set on the re-executed child so a failed preload can never loop
_REEXEC_MARK = "VELOXQUANT_OPENBLAS_REEXEC"


def openblas_path() -> Optional[str]:
    """Debian's pthread OpenBLAS for this machine's architecture, or None when absent."""
    machine = platform.machine()
    candidates = [f"/usr/lib/{machine}-linux-gnu/openblas-pthread/libopenblas.so.0"]
    candidates += sorted(glob.glob("/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0"))
    for c in candidates:
        if os.path.exists(c):
            return c
    return None


def _preloaded(env) -> List[str]:
    return [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]


def ensure_openblas(argv: Optional[List[str]] = None) -> None:
    """Re-exec ``sys.executable argv`` with OpenBLAS in LD_PRELOAD when useful; returns otherwise.

    No-op when: not Linux, env ``VELOXQUANT_NO_OPENBLAS`` is set, OpenBLAS is not installed, it
    is already preloaded, or this process is itself the re-executed child.
    """
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT_ENV):
        return
    if os.environ.get(_REEXEC_MARK):
        return
    lib = openblas_path()
    if lib is None or lib in _preloaded(os.environ):
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join([lib] + _preloaded(os.environ))
    env[_REEXEC_MARK] = "1"
    if argv is None:
        argv = _original_argv()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + argv, env)


def load_openblas_global() -> bool:
    """In-process alternative to the re-exec: ``dlopen`` OpenBLAS with RTLD_GLOBAL before MLX loads.

    Symbols of a library opened RTLD_GLOBAL precede a later library's own dependencies, so MLX's
    BLAS calls then go to OpenBLAS. Only effective before ``import mlx``; used by the test suite,
    which cannot re-exec pytest. Returns True when OpenBLAS was loaded.
    """
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT_ENV):
        return False
    if "mlx.core" in sys.modules:
        return False
    lib = openblas_path()
    if lib is None:
        return False
    try:
        ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
    except OSError:
        return False
    return True


def _original_argv() -> List[str]:
    """The arguments that started this interpreter (``-m module`` kept), for the re-exec."""
    orig = getattr(sys, "orig_argv", None)  # Python 3.10+: the full interpreter command line
    if orig:
        return list(orig[1:])
    return list(sys.argv)


def loaded_blas() -> str:
    """Which BLAS serves MLX in this process (from /proc/self/maps).

    numpy's own bundled OpenBLAS (``numpy.libs``) is ignored: MLX does not call it.
    """
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown (no /proc/self/maps)"
    libs = set()
    for line in maps.splitlines():
        parts = line.split()
        path = parts[-1] if len(parts) >= 6 else ""
        base = os.path.basename(path).lower()
        if ("blas" in base or "accelerate" in base) and "numpy.libs" not in path and "scipy" not in base:
            libs.add(path)
    preloaded = [p for p in libs if "openblas" in p]
    if preloaded:
        return f"OpenBLAS ({sorted(preloaded)[0]})"
    if libs:
        return "reference BLAS bundled with MLX (" + ", ".join(sorted(libs)) + "); install libopenblas0-pthread"
    return "no BLAS mapped yet"
