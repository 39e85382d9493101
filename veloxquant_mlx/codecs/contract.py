"""The codec contract: what a code layout offers to the caches and to attention on codes.

A codec turns one stream of head vectors (the keys, or the values, of one layer) into a dict of stored arrays
("codes") and offers everything attention needs straight from those arrays. Caches and
:mod:`veloxquant_mlx.attention.packed_sdpa` call only these members, so a new layout is one file in
:mod:`veloxquant_mlx.codecs` plus one line of its registry.

Shapes: inputs ``x`` are ``(B, H, T, d)`` floats; queries ``q`` and weights ``p`` come grouped per KV head,
``(B, H, M, d)`` and ``(B, H, M, n)`` (``M`` = query rows per KV head); codes hold ``n`` tokens in the
codec's own layout (token axis 2, or last for transposed layouts), which it declares (`Codec.code_layout`, one
`CodeField` per array) so that a cache allocates and indexes codes without encoding probes.

Fitted parameters are per head (axis 0 = heads) and pure to compute: `Codec.fitted_from` returns them without
changing the codec, `Codec.with_fitted` returns a new codec holding them (``fit`` / ``load_fitted`` are the in-place
forms, kept for the caches that hold one codec per sequence). Shared implementations:
:mod:`veloxquant_mlx.codecs.common` (`FittedParams`, `PerTokenLayout`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Protocol, Sequence, Tuple, runtime_checkable

import mlx.core as mx

Codes = Dict[str, mx.array]


@dataclass(frozen=True)
class CodeField:
    """Where the tokens of one stored array lie: what a cache needs to preallocate, index and grow it.

    For ``x`` ``(1, heads, k * token_block, d)``, ``encode(x)[field]`` has ``block_shape`` with ``block_shape[axis]``
    multiplied by ``k`` (and axis 0 = the batch rows). Tokens ``[i * token_block, (i + 1) * token_block)`` are
    entries ``[i * units, (i + 1) * units)`` along ``axis``.
    """

    axis: int  # the token axis (>= 1: axis 0 is the batch)
    units: int  # array entries along ``axis`` per ``token_block`` tokens
    block_shape: Tuple[int, ...]  # one row's arrays of one token block: ``(1, heads, ...)``
    dtype: mx.Dtype

    def shape(self, blocks: int, rows: int = 1) -> Tuple[int, ...]:
        """The field's shape for ``rows`` batch rows of ``blocks`` token blocks."""
        shape = list(self.block_shape)
        shape[0], shape[self.axis] = rows, self.units * blocks
        return tuple(shape)


@dataclass(frozen=True)
class AffineCodes:
    """Codes in MLX's affine format, as a compiled attention reads them (`Codec.affine_codes`, optional member).

    ``w``: uint32 words of ``bits``-bit fields (a little-endian bit stream); ``scales`` / ``biases``: one per
    ``group`` fields; ``biases`` None means symmetric levels (``x = scale * (code - zero)``), whose ``scales`` may
    be uint8 log-grid codes (`veloxquant_mlx.codecs.affine_sym_log.decode_log_scales`). ``tokens_last``:
    ``w`` is ``(B, H, d, n*bits/32)`` with groups along tokens, else ``(B, H, n, d*bits/32)`` with groups along
    channels. ``levels``: None, or a codebook ``(2**bits,)`` float32 that each code indexes first (Lloyd-Max codes:
    ``x = scale * levels[code]``). A decoded vector is ``Pi^T y + mean`` (``rotation``: the ``(d, d)`` Pi,
    ``mean``: None or per head ``(heads, d)`` float32); for keys, scores are ``(Pi q) . y + q . mean``.

    ``extra``: None, or a second additive code stream of the same tokens (tokens first, with ``levels``): for keys
    (TurboQuant-Prod's QJL signs, RVQ's residual codebook) one more score term ``(rotation_2 q) . y_2`` with its
    own per-token ``scales`` and its ``rotation`` an ``(m, d)`` map of the query; for values (RVQ) levels added
    to the first stream's under the first stream's very ``scales`` and ``rotation`` objects.
    """

    w: mx.array
    scales: mx.array
    biases: Optional[mx.array]
    bits: int
    group: int
    tokens_last: bool
    rotation: mx.array
    mean: Optional[mx.array] = None
    zero: float = 0.0
    levels: Optional[mx.array] = None
    extra: Optional["AffineCodes"] = None


@runtime_checkable
class Codec(Protocol):
    """One code layout (FAISS's ``compute_codes`` / ``decode`` / query-to-code distances, for MLX caches)."""

    d: int  # head dim of the vectors it codes
    bits: int  # code bits per coordinate (the layout's nominal width)
    token_block: int  # tokens coded together: a cache appends, trims and deletes whole blocks

    # -- layout (declared: a cache never probes `encode`) ----------------------------------------
    def code_layout(self, heads: int) -> Dict[str, CodeField]:
        """``{field: CodeField}``: exactly the arrays `encode` returns for ``(1, heads, k * token_block, d)``."""

    # -- fitting (per-head parameters from the first tokens, then frozen) -------------------------
    # Every fitted array is per head: axis 0 = heads, so a batch concatenates its rows' arrays along axis 0
    # (rows x heads) and a folded ``(1, rows * heads, ...)`` history codes with them.
    @property
    def fitted(self) -> bool:
        """Whether `encode` may run: fitted, or a codec that fits nothing (`blank_fitted` is ``{}``)."""

    def fitted_from(self, x: mx.array) -> Codes:
        """The per-head parameters a fit on ``x`` ``(B, H, T, d)`` gives, ``{name: (H, ...)}``, without changing
        the codec. The B rows are pooled as more tokens of the same H heads (caches pass ``B = 1``; fit each
        sequence apart for per-sequence parameters). ``{}`` for a codec that fits nothing."""

    def with_fitted(self, arrays: Codes) -> "Codec":
        """A new codec of the same settings holding ``arrays`` (validated as `load_fitted`); ``self`` unchanged.
        ``with_fitted({})`` is the unfitted codec."""

    def blank_fitted(self, heads: int) -> Codes:
        """Finite placeholder parameters of exactly the shapes and dtypes a fit on ``heads`` heads gives (what a
        batch row holds before its own fit; no coded token reads them); ``{}`` for a codec that fits nothing."""

    def fit(self, x: mx.array) -> None:
        """In place: ``self`` takes `fitted_from` ``(x)``; later tokens reuse the parameters."""

    def fitted_arrays(self) -> Codes:
        """The fitted parameters as arrays (they travel with the codes, and count in a cache's bytes)."""

    def load_fitted(self, arrays: Codes) -> None:
        """In place: inverse of `fitted_arrays` (validates names, shapes and dtypes; raises ValueError naming the
        array). An empty dict restores the codec unfitted (what `fitted_arrays` gives before the first `fit`)."""

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
