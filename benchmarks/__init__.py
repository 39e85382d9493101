"""The benchmarks of veloxquant_mlx (outside the installed package; figures and commands in BENCHMARKS.md).

A package only so that the research probes run as modules from the repository root
(``python -m benchmarks.probes.NAME``) and import the shared helper as ``benchmarks._common``; the entry points
(quality, e2e_speed, memory, server_load, soak, distributed) run as scripts, ``python benchmarks/NAME.py``, and
import it as ``_common``. See `benchmarks._common`.
"""
