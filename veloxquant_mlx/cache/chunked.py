"""`TurboQuantChunkedPackedCache`: the compressed counterpart of mlx_lm's ``ChunkedKVCache`` (Llama 4's chunked
attention layers, three of every four).

mlx_lm's cache keeps, before each update, the newest ``chunk_size`` tokens (``maybe_trim_front``), then appends the
update's; the model masks each query to the tokens of its own chunk with a mask array it builds from
``start_position`` and ``offset``. That is exactly the token set of a window of ``chunk_size + 1`` tokens with
nothing kept forever (`TurboQuantRotatingPackedCache`: a multi-token update keeps ``max_size - 1`` old tokens, a
one-token update ``max_size`` in all), so this is that window with the attributes the model reads.
"""
from __future__ import annotations

from typing import Any, Dict

from veloxquant_mlx.cache.packed_cache import TurboQuantRotatingPackedCache
from veloxquant_mlx.validate import check_int


class TurboQuantChunkedPackedCache(TurboQuantRotatingPackedCache):
    """Packed keys and values of a chunked-attention layer (``chunk_size`` as mlx_lm's ``ChunkedKVCache``)."""

    def __init__(self, config=None, chunk_size: int = None, **options):
        self.chunk_size = check_int("chunk_size", chunk_size, 1)
        super().__init__(config, max_size=self.chunk_size + 1, keep=0, **options)

    @property
    def start_position(self) -> int:
        """Absolute position of the oldest token the next update attends (what ``maybe_trim_front`` leaves)."""
        return self.offset - min(self._stored(), self.chunk_size)

    def maybe_trim_front(self) -> None:
        """Nothing to do now: the next update keeps the newest ``chunk_size`` tokens (see the module docstring)."""

    def is_trimmable(self) -> bool:
        return self.offset <= self.chunk_size

    def _cache_meta(self) -> Dict[str, Any]:
        return {"fetch_placeholders": self.fetch_placeholders, "chunk_size": self.chunk_size}

    @classmethod
    def merge(cls, caches):
        raise ValueError(f"{cls.__name__} does not batch (mlx_lm's ChunkedKVCache does not either): generate one "
                         "sequence at a time with this model")
