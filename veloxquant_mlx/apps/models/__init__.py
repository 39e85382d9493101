"""Model loading: the embedded SmolLM2-135M and Gemma 3 270M GGUFs, llama and gemma3 GGUF files, mlx_lm directories."""
from veloxquant_mlx.apps.models.gemma3 import GEMMA3_INSTALL_HINT, GEMMA3_MODEL, embedded_gemma3_path
from veloxquant_mlx.apps.models.loader import (
    DEFAULT_MODEL,
    INSTALL_HINT,
    MODEL_HELP,
    ModelPackageMissing,
    embedded_gguf_path,
    load_gguf,
    load_model,
    max_context,
)

__all__ = [
    "DEFAULT_MODEL",
    "GEMMA3_INSTALL_HINT",
    "GEMMA3_MODEL",
    "INSTALL_HINT",
    "MODEL_HELP",
    "embedded_gemma3_path",
    "ModelPackageMissing",
    "embedded_gguf_path",
    "load_gguf",
    "load_model",
    "max_context",
]
