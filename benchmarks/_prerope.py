"""Issue 47's pre-RoPE key lever, measured for quality (``benchmarks/quality.py --configs pre-NAME``).

KVQuant's observation: before RoPE a key channel's statistics do not move with the position, so a per-channel
block code (or a centring mean) fits them; after RoPE, a channel pair with a large mean turns into a sinusoid over
positions, and every 128-token key block has to span its swing. `PreRopeKeys` wraps one of our caches so that it
stores the keys as they were *before* RoPE (the layer's own RoPE undone at each position: ``mx.fast.rope`` with the
negated scale) and hands attention the decoded history with RoPE re-applied at every stored position.

What this is and is not (a labelled research mode, not a product path):
- The stored arrays are the wrapped cache's own: the same codecs, the same bytes (`measure_bits` and the eval's
  ``memory`` read them), only the keys coded are pre-RoPE ones. So its KL is what the lever would give a cache that
  runs RoPE inside attention on the codes.
- Attention runs on the decoded history (mlx_lm's own SDPA), not on the codes: speed means nothing here. The
  compiled kernel and the reference attention on codes cannot read pre-RoPE codes yet (a key must be rotated at
  its own position before it is scored, so one rotated query no longer scores every key from its codes).
- One sequence, no sliding window (positions are the stored slots): what quality.py runs. A calibration fitted on
  post-RoPE keys does not apply to pre-RoPE ones, so ``pre-NAME+cal`` is refused.

``unrotated=True`` (``quality.py --configs nr-NAME`` after RoPE, ``prenr-NAME`` before) also takes the key codec's
own rotation out of play: keys go in counter-rotated (``Pi^T k``), so the codec codes the model's own channels, and
come back rotated once more. It tells whether RoPE on codes could skip the rotation: without it a key's RoPE is a
per-token rotation of the query, O(d) per token; with it, O(d^2) (the query must pass the rotation per token).

``offset=True`` (``quality.py --configs off-NAME``, issue 54): keys stay after RoPE, but what is coded is
``k_t - R_t mu``, ``mu`` per head the mean of the first update's keys before RoPE (``R_t``: RoPE at position t), and
``R_t mu`` is added back when read; attention on codes would add ``q . R_t mu`` from per-pair tables, O(d) per token,
with the codes scored as they are. It tells how much of the pre-RoPE gain is that static offset (``mu``: H x d floats,
not counted in the bytes).
"""
from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.quant.rotation import make_rotation


def rope_settings(rope) -> dict:
    """``mx.fast.rope`` keywords of a layer's RoPE module (mlx.nn.RoPE: dims, traditional, base, scale); ValueError
    for the scaled RoPE variants (Llama 3, YaRN, SuScaled), which this probe does not invert."""
    try:
        return {"dims": int(rope.dims), "traditional": bool(rope.traditional), "base": float(rope.base),
                "scale": float(rope.scale)}
    except AttributeError as e:
        raise ValueError(f"pre-RoPE probe: the layer's RoPE ({type(rope).__name__}) is not a plain mlx.nn.RoPE "
                         f"(dims, traditional, base, scale)") from e


class PreRopeKeys:
    """One layer's cache storing pre-RoPE keys in ``inner`` (one of ours, built with ``fetch_placeholders=False``
    so it returns the decoded history); every other attribute is the inner cache's."""

    def __init__(self, inner, rope: dict, pre_rope: bool = True, unrotated: bool = False, offset: bool = False):
        self.inner, self.rope, self.pre_rope, self.unrotated = inner, rope, pre_rope, unrotated
        # (not `offset`: mlx_lm reads the cache's offset) mu (1, H, 1, d) float32: the first update's mean pre-RoPE key
        self.less_mean, self.mu = offset, None
        self.key_rotation = None

    def __getattr__(self, name):  # offset, make_mask, state, nbytes, live_nbytes, ...: the inner cache's
        if name == "attend_packed":  # attention must see the re-roped history, never the inner cache's codes
            raise AttributeError(name)
        return getattr(self.__dict__["inner"], name)

    def _rotate(self, keys: mx.array, offset: int, sign: float) -> mx.array:
        r = self.rope
        return mx.fast.rope(keys, r["dims"], traditional=r["traditional"], base=r["base"], scale=sign * r["scale"],
                            offset=offset)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """``keys`` ``(1, H, T, d)`` after RoPE at positions ``offset..offset+T``: stored before RoPE; returns the
        whole decoded history with RoPE at positions ``0..n``."""
        if keys.shape[0] != 1:
            raise ValueError(f"the pre-RoPE probe runs one sequence, got a batch of {keys.shape[0]}")
        dtype = keys.dtype
        if self.less_mean:
            if self.mu is None:
                self.mu = mx.mean(self._rotate(keys.astype(mx.float32), self.inner.offset, -1.0), axis=2,
                                  keepdims=True)
            keys = (keys.astype(mx.float32) - self._at(keys.shape[2], self.inner.offset)).astype(dtype)
        if self.pre_rope:
            keys = self._rotate(keys, self.inner.offset, -1.0)
        if self.unrotated:
            keys = self._codec_rotation(keys.shape[-1]).invert(keys).astype(dtype)
        k, v = self.inner.update_and_fetch(keys, values)
        if k.shape[2] != self.inner.offset:  # positions are the stored slots: an evicting window breaks that
            raise ValueError(f"the pre-RoPE probe needs every token kept (no sliding window): the cache holds "
                             f"{k.shape[2]} of {self.inner.offset} tokens")
        self._check_rotation()
        k = k.astype(mx.float32)
        if self.unrotated:
            k = self.key_rotation.apply(k)
        if self.less_mean:
            k = k + self._at(k.shape[2], 0)
        return (self._rotate(k, 0, 1.0) if self.pre_rope else k).astype(dtype), v

    def _at(self, n: int, offset: int) -> mx.array:
        """``R_t mu`` at positions ``offset .. offset + n`` ``(1, H, n, d)``."""
        return self._rotate(mx.broadcast_to(self.mu, self.mu.shape[:2] + (n, self.mu.shape[-1])), offset, 1.0)

    def _codec_rotation(self, d: int):
        """The rotation the inner cache's key codec applies (`make_rotation` shares one object per seed and kind)."""
        if self.key_rotation is None:
            o = self.inner.options
            self.key_rotation = make_rotation(d, o.seed, o.rotation)
        return self.key_rotation

    def _check_rotation(self) -> None:
        if not self.unrotated:
            return
        codec = getattr(getattr(self.inner, "rows", None), "k_codec", None)
        if getattr(codec, "rotation", None) is not self.key_rotation:
            raise ValueError("unrotated probe: the inner key codec's rotation is not make_rotation(d, seed, rotation)")


def pre_rope_caches(model, caches, pre_rope: bool = True, unrotated: bool = False, offset: bool = False) -> list:
    """``caches`` (one per layer of ``model``, ours, decoded history) wrapped in `PreRopeKeys` with each layer's RoPE;
    a sliding-window layer (the model's own cache a ``RotatingKVCache``: Gemma 3) is left as it is (its slots are
    not its positions), so the lever is measured on the full-attention layers."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    layers = model.layers
    if len(layers) != len(caches):
        raise ValueError(f"pre-RoPE probe: {len(caches)} caches for {len(layers)} layers")
    windows = [isinstance(c, RotatingKVCache) for c in make_prompt_cache(model)]
    return [c if w else PreRopeKeys(c, rope_settings(layer.self_attn.rope), pre_rope, unrotated, offset)
            for layer, c, w in zip(layers, caches, windows)]
