"""A tokenizer for mlx_lm's TokenizerWrapper in tests with tiny random models (no files, no network): token i is
the text '<i>' (the library's own, which the architecture checks use too)."""
from veloxquant_mlx.apps.eval.architectures import IdTokenizer as FakeTokenizer

__all__ = ["FakeTokenizer"]
