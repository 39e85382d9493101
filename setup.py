"""Builds the compiled attention on codes during ``pip install`` (metadata lives in pyproject.toml).

The kernel is optional: when it cannot be built (no CMake or compiler, a nanobind that does not match the installed
MLX), the install goes on with a warning and attention runs on the pure-MLX reference. ``scripts/setup.sh`` and
CI build it, and the test suite checks that it is there.
"""
import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
KERNEL = "veloxquant_mlx.attention._coded_attention"


def _builder():
    """veloxquant_mlx/attention/build_kernel.py loaded by path (the package is not importable yet)."""
    spec = importlib.util.spec_from_file_location("_vq_build_kernel", ROOT / "veloxquant_mlx/attention/build_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernel(build_ext):
    def build_extensions(self):
        # An extension that could not be built leaves the list, so that nothing later (the editable install's
        # copy, the wheel's outputs) looks for its library: the install goes on without it.
        built = []
        for ext in self.extensions:
            try:
                self.build_extension(ext)
                built.append(ext)
            except Exception as e:  # noqa: BLE001 - optional: never fail the install over it
                print(f"WARNING: veloxquant kernel not built ({e}); attention will run on the pure-MLX reference. "
                      "Rebuild later with: python -m veloxquant_mlx.attention.build_kernel", file=sys.stderr)
        self.extensions = built

    def build_extension(self, ext):
        builder = _builder()
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        path = builder.build(out_dir=out_dir, build_dir=Path(self.build_temp).resolve() / "kernel")
        print(f"veloxquant kernel: built {path} against MLX {builder.mx.__version__} ({builder.mlx.__path__[0]})")


SOURCES = [f"veloxquant_mlx/attention/csrc/{name}.cpp" for name in ("coded_attention", "affine_encode", "gather_rows")]

setup(ext_modules=[Extension(KERNEL, sources=SOURCES)],
      cmdclass={"build_ext": BuildKernel})
