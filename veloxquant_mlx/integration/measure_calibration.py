"""`calibrate`: run a model on calibration text and measure what its caches' channel weights need.

It runs the model with attention routed (`veloxquant_mlx.integration`), so it sits above the integration, beside
it, while the `veloxquant_mlx.calibration` package (the weights' math and the `Calibration` file) sits below the
options and the builder that read it.

Per layer and KV head, over every token of the calibration text: the keys' per-channel variance, the queries'
per-channel second moment (summed over the query heads sharing the KV head; queries and keys after RoPE, as the
cache sees them), the values' per-channel second moment, and the output projection's squared column norms (how
much an error in each value channel moves the layer's output). The weights are
`veloxquant_mlx.quant.channel_weights.channel_weights` of those.

The default calibration text (no ``tokens`` given) is text the model writes itself, greedily, from
`DEFAULT_PROMPTS`: never one of the evaluation corpora (`veloxquant_mlx.apps.eval.corpus`), and available offline for
any model with a chat template.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm import generate as mlx_generate
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.integration.calibration import Calibration, key_rotations, model_fingerprint
from veloxquant_mlx.quant.channel_weights import channel_weights
from veloxquant_mlx.integration.scan import attention_is_routable
from veloxquant_mlx.integration.routing import use_packed_attention
from veloxquant_mlx.integration.model_shape import model_kv_shape, vocab_size
from veloxquant_mlx.validate import check_finite, check_int

DEFAULT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a refrigerator keeps food cold.",
    "Describe the history of the printing press and how it changed Europe.",
    "Give detailed advice to someone preparing for their first job interview.",
)
DEFAULT_TOKENS_PER_PROMPT = 320
CHUNK = 256
# The key-rotation probe (`probe_key_rotations`): this many pseudo-random token ids from this seed. 128 ids moved a
# window layer of Gemma 3 across the threshold with one seed of two; 256 gave the same layers as real text.
PROBE_TOKENS = 256
PROBE_SEED = 0


class _Recorder(KVCache):
    """mlx_lm's plain cache that also sums what calibration measures (attention routed to `attend_packed`, so
    it sees the queries)."""

    def __init__(self, sums: dict):
        super().__init__()
        self.sums = sums

    def _add(self, name: str, x: mx.array) -> None:
        self.sums[name] = x if name not in self.sums else self.sums[name] + x

    def update_and_fetch(self, keys, values):
        k, v = keys.astype(mx.float32), values.astype(mx.float32)
        self._add("k1", k.sum(axis=(0, 2)))
        self._add("k2", (k * k).sum(axis=(0, 2)))
        self._add("v2", (v * v).sum(axis=(0, 2)))
        self.sums["n"] = self.sums.get("n", 0) + k.shape[0] * k.shape[2]
        return super().update_and_fetch(keys, values)

    def attend_packed(self, queries, scale, mask, sinks=None):
        q = queries.astype(mx.float32)
        B, Hq, L, d = q.shape
        hkv = self.keys.shape[1]
        self._add("q2", (q * q).reshape(B, hkv, Hq // hkv, L, d).sum(axis=(0, 2, 3)))
        self.sums["nq"] = self.sums.get("nq", 0) + B * L
        k, v = self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        if sinks is not None:
            return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def default_calibration_tokens(model, tokenizer, prompts: Sequence[str] = DEFAULT_PROMPTS,
                               tokens_per_prompt: int = DEFAULT_TOKENS_PER_PROMPT) -> List[List[int]]:
    """Token sequences (chat prompt + the model's own greedy answer), one per prompt. A tokenizer without a chat
    template (a base model: Gemma 3 270M) gets the prompt as plain text, which it continues."""
    check_int("tokens_per_prompt", tokens_per_prompt, 1)
    out = []
    for p in prompts:
        if getattr(tokenizer, "has_chat_template", False):
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        else:
            prompt = list(tokenizer.encode(p))
        answer = mlx_generate(model, tokenizer, prompt, max_tokens=tokens_per_prompt, verbose=False)
        out.append(list(prompt) + list(tokenizer.encode(answer, add_special_tokens=False)))
    return out


def _output_power(layer, kv_heads: int, head_dim: int) -> Optional[mx.array]:
    """``(kv_heads, head_dim)``: squared column norms of the layer's output projection, summed over the query heads
    of each KV head; None when the layer has no ``self_attn.o_proj``."""
    proj = getattr(getattr(layer, "self_attn", None), "o_proj", None)
    if proj is None or not hasattr(proj, "weight"):
        return None
    w = proj.weight
    if hasattr(proj, "scales"):  # QuantizedLinear
        w = mx.dequantize(w, proj.scales, getattr(proj, "biases", None), proj.group_size, proj.bits)
    w = w.astype(mx.float32)
    if w.shape[1] % (kv_heads * head_dim):
        return None
    col = (w * w).sum(axis=0).reshape(kv_heads, -1, head_dim)
    return col.sum(axis=1)


def calibrate(model, tokens=None, *, tokenizer=None, power: float = 0.25, chunk: int = CHUNK,
              description: Optional[str] = None, progress: bool = False) -> Calibration:
    """Measure ``model`` on calibration text -> a `Calibration` (save it with ``.save(path)``).

    tokens: token ids (a list of ints, or a list of such lists: independent sequences); None: the default
        calibration text, which the model writes from `DEFAULT_PROMPTS` (needs ``tokenizer``).
    power: exponent of the channel weights (0.25: the optimum for rotated codes; 0 gives weights of 1).
    chunk: prefill chunk length. description: what the text is (recorded in the file).
    """
    if not hasattr(model, "layers"):
        raise TypeError(f"model must be an mlx_lm model with .layers, got {type(model).__name__}")
    if check_finite("power", power) < 0:
        raise ValueError(f"power must be >= 0, got {power!r}")
    check_int("chunk", chunk, 1)
    if not attention_is_routable(model):
        raise ValueError("calibrate needs a model whose attention calls mlx_lm's scaled_dot_product_attention "
                         "(it measures the queries there); this model's attention does not")
    t0 = time.perf_counter()
    if tokens is None:
        if tokenizer is None:
            raise ValueError("calibrate: pass tokens=..., or tokenizer=... to use the default calibration text")
        seqs = default_calibration_tokens(model, tokenizer)
        text = {"source": "generated", "description": description or "the model's own greedy answers to "
                f"{len(DEFAULT_PROMPTS)} fixed prompts (veloxquant_mlx.integration.measure_calibration.DEFAULT_PROMPTS)"}
    else:
        seqs = _token_lists(tokens)
        text = {"source": "user", "description": description or "token ids given by the caller"}
    arrays = _measure(model, seqs, chunk, progress=progress, t0=t0)
    arrays["key_weights"] = mx.stack([channel_weights(q, k, power) for q, k in
                                      zip(arrays["query_power"], arrays["key_variance"])])
    arrays["value_weights"] = mx.stack([channel_weights(o, v, power) for o, v in
                                        zip(arrays["output_power"], arrays["value_power"])])
    mx.eval(arrays)
    text.update(tokens=int(sum(len(s) for s in seqs)), sequences=len(seqs),
                seconds=round(time.perf_counter() - t0, 1))
    return Calibration(arrays=arrays, model=model_fingerprint(model), text=text, power=float(power))


def _pipelined(model) -> bool:
    """Whether ``model`` (or a module of it) is split by layers over ranks (mlx_lm's ``pipeline``: its
    ``pipeline_size`` above 1)."""
    modules = model.modules() if callable(getattr(model, "modules", None)) else [model]
    return any(isinstance(getattr(m, "pipeline_size", None), int) and m.pipeline_size > 1 for m in modules)


def _measure(model, seqs: List[List[int]], chunk: int, *, progress: bool = False, t0: float = 0.0) -> dict:
    """`STATISTICS` of ``model`` over the token sequences ``seqs``: name -> float32 ``(layers, kv_heads, head_dim)``."""
    layers, kv_heads, head_dim = model_kv_shape(model)
    sums = [dict() for _ in range(layers)]
    # The sums need no logits: the output head (the vocabulary times the hidden size per token: on SmolLM2-135M a
    # fifth of the probe, nearly half of it on each rank of 3, where nothing else is replicated) and the last
    # layer's MLP are left unevaluated, except on a pipeline-sharded model, whose ranks send to the next one as
    # part of the logits. (Every rank of a tensor-parallel one evaluates the same arrays: the same collectives.)
    pipelined = _pipelined(model)
    with use_packed_attention():
        for seq in seqs:
            cache = [_Recorder(sums[i]) for i in range(layers)]
            x = mx.array(seq, dtype=mx.int32)[None]
            for s in range(0, x.shape[1], chunk):
                logits = model(x[:, s: s + chunk], cache=cache)
                mx.eval(([logits] if pipelined else []) + [d.get("k2") for d in sums] + [d.get("q2") for d in sums])
            if progress:
                print(f"calibrate: {len(seq)} tokens measured ({time.perf_counter() - t0:.0f} s)", flush=True)
    stats = {name: [] for name in ("key_variance", "query_power", "value_power", "output_power")}
    for i, s in enumerate(sums):
        if "q2" not in s:
            raise ValueError(f"calibrate: layer {i} never attended (its attention does not reach the routing)")
        n, nq = s["n"], s["nq"]
        mean = s["k1"] / n
        stats["key_variance"].append(mx.maximum(s["k2"] / n - mean * mean, 0.0))
        stats["query_power"].append(s["q2"] / nq)
        stats["value_power"].append(s["v2"] / n)
        o = _output_power(model.layers[i], kv_heads, head_dim)
        stats["output_power"].append(mx.ones((kv_heads, head_dim)) if o is None else o)
    return {name: mx.stack(v).astype(mx.float32) for name, v in stats.items()}


def probe_key_rotations(model) -> Tuple[Optional[str], ...]:
    """Per layer: ``"none"`` where its block keys measure better coded in the model's own channels
    (`veloxquant_mlx.integration.calibration.key_rotations`), else None (the options' rotation), measured
    on `PROBE_TOKENS` pseudo-random token ids (`PROBE_SEED`): no text at all, so nothing it decides was fitted on
    anything a user evaluates. Which channels the queries read and how much each key channel varies are the
    weights' doing: on Gemma 3 270M and SmolLM2-135M random ids flag the same layers as the models' own text
    (BENCHMARKS.md, issue 55). ValueError as `calibrate` for a model it cannot measure."""
    vocab = vocab_size(model)
    if vocab is None:
        raise ValueError(f"{type(model).__name__} states no vocab_size: the key-rotation probe cannot draw token ids")
    ids = np.random.default_rng(PROBE_SEED).integers(0, vocab, PROBE_TOKENS).tolist()
    if not attention_is_routable(model):
        raise ValueError("the key-rotation probe needs a model whose attention calls mlx_lm's "
                         "scaled_dot_product_attention (it measures the queries there); this model's attention does not")
    a = _measure(model, [ids], PROBE_TOKENS)
    return key_rotations(a["query_power"], a["key_variance"])


def _token_lists(tokens) -> List[List[int]]:
    if isinstance(tokens, mx.array):
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise ValueError("tokens must be a non-empty list of token ids (or a list of such lists)")
    seqs = [list(t) for t in tokens] if isinstance(tokens[0], (list, tuple)) else [list(tokens)]
    for i, s in enumerate(seqs):
        if len(s) < 2 or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in s):
            raise ValueError(f"tokens[{i}] must hold at least 2 non-negative int token ids")
    return seqs
