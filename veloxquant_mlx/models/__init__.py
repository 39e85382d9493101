"""Model loading: the embedded SmolLM2-135M GGUF, llama GGUF files, mlx_lm directories."""
from .loader import (
    DEFAULT_MODEL,
    INSTALL_HINT,
    ModelPackageMissing,
    embedded_gguf_path,
    load_gguf,
    load_model,
    max_context,
)

__all__ = [
    "DEFAULT_MODEL",
    "INSTALL_HINT",
    "ModelPackageMissing",
    "embedded_gguf_path",
    "load_gguf",
    "load_model",
    "max_context",
]
