"""The codec contract: what a code layout offers to the caches and to attention on codes.

A codec turns one stream of head vectors (the keys, or the values, of one layer) into a dict of stored arrays
("codes") and offers everything attention needs straight from those arrays. Caches and
:mod:`veloxquant_mlx.attention.packed_sdpa` call only these members, so a new layout is one file in
:mod:`veloxquant_mlx.codecs` plus one line of its registry.

Shapes: inputs ``x`` are ``(B, H, T, d)`` floats; queries ``q`` and weights ``p`` come grouped per KV head,
``(B, H, M, d)`` and ``(B, H, M, n)`` (``M`` = query rows per KV head); codes hold ``n`` tokens in the
codec's own layout (token axis 2, or last for transposed layouts: only the codec knows).
"""
from __future__ import annotations

from typing import Dict, Optional, Protocol, Sequence, runtime_checkable

import mlx.core as mx

Codes = Dict[str, mx.array]


@runtime_checkable
class Codec(Protocol):
    """One code layout (FAISS's ``compute_codes`` / ``decode`` / query-to-code distances, for MLX caches)."""

    d: int  # head dim of the vectors it codes
    bits: int  # code bits per coordinate (the layout's nominal width)
    token_block: int  # tokens coded together: a cache appends, trims and deletes whole blocks

    # -- fitting (per-head parameters from the first tokens, then frozen) -------------------------
    @property
    def fitted(self) -> bool: ...

    def fit(self, x: mx.array) -> None:
        """Fix the per-head parameters from ``x`` ``(B, H, T, d)``; later tokens reuse them."""

    def fitted_arrays(self) -> Codes:
        """The fitted parameters as arrays (they travel with the codes, and count in a cache's bytes)."""

    def load_fitted(self, arrays: Codes) -> None:
        """Inverse of `fitted_arrays` (validates shapes; raises ValueError naming the array). An empty dict
        restores the codec unfitted (what `fitted_arrays` gives before the first `fit`)."""

    # -- coding ---------------------------------------------------------------------------------
    def encode(self, x: mx.array) -> Codes:
        """``(B, H, T, d)`` (T a multiple of `token_block`) -> stored arrays of T tokens."""

    def decode(self, codes: Codes, dtype) -> mx.array:
        """Stored arrays of n tokens -> ``(B, H, n, d)`` in ``dtype``."""

    # -- token bookkeeping (the layout decides where the token axis is) -------------------------
    def n_tokens(self, codes: Codes) -> int: ...

    def slice_tokens(self, codes: Codes, start: int, stop: int) -> Codes:
        """Tokens ``[start, stop)`` (aligned to `token_block`) of stored arrays, without copying."""

    def concat(self, chunks: Sequence[Codes]) -> Codes:
        """Arrays of consecutive token ranges -> one set of arrays."""

    def check_codes(self, codes: Codes, name: str) -> None:
        """ValueError naming ``name`` and the array when ``codes`` are not this layout's (restores)."""

    # -- attention on codes ----------------------------------------------------------------------
    def scores(self, q: mx.array, codes: Codes, packed_rows: Optional[int] = None) -> mx.array:
        """``q . decode(codes)^T``: float32 ``(B, H, M, d)`` queries -> ``(B, H, M, n)`` float32.

        ``packed_rows``: with more than that many rows a codec may decode once and use BLAS (None: its
        own measured crossover). Every term of the reconstruction is included (a centring mean, too).
        """

    def decoded_offset(self) -> Optional[mx.array]:
        """The ``(H, d)`` float32 vector every decoded token carries on top of its code part, or None.

        Lets attention add ``sum(p) * offset`` once for several parts (see `weighted_sum`).
        """

    def weighted_sum(self, p: mx.array, codes: Codes, packed_rows: Optional[int] = None,
                     with_offset: bool = True) -> mx.array:
        """``p @ decode(codes)``: float32 ``(B, H, M, n)`` weights -> ``(B, H, M, d)`` float32.

        ``with_offset=False`` leaves out ``sum(p) * decoded_offset()`` (the caller adds it).
        """


def check_codec(codec, name: str) -> None:
    """TypeError naming ``name`` unless ``codec`` implements the contract."""
    if not isinstance(codec, Codec):
        raise TypeError(f"{name} must implement veloxquant_mlx.codecs.Codec, got {type(codec).__name__}")
