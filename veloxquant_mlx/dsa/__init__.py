"""Data-structure helpers: bit packing of quantization codes."""
from .bit_pack import BitPackBuffer, pack, packed_bytes, packed_words, unpack

__all__ = ["BitPackBuffer", "pack", "packed_bytes", "packed_words", "unpack"]
