"""The ``veloxquant`` program (the console script and ``python -m veloxquant_mlx``).

MLX maps its BLAS when it is first imported, so the process first re-executes itself with Debian's OpenBLAS
preloaded (:mod:`veloxquant_mlx.apps.blas`, ~50x on float32 matmuls on CPU): that call is what this module does when it
is imported, before the commands (:mod:`veloxquant_mlx.apps.cli`, which import MLX) are. Import it only to run the
program.
"""
import sys

from veloxquant_mlx.apps.blas import ensure_openblas

ensure_openblas()

from veloxquant_mlx.apps.cli import exit_process, main  # noqa: E402 (after the re-exec, see above)


def run() -> None:
    """The ``veloxquant`` console script: the commands of :mod:`veloxquant_mlx.apps.cli` on ``sys.argv``."""
    exit_process(main(sys.argv[1:]))
