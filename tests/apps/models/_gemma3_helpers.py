"""Helpers of test_gemma3.py: llama.cpp's SentencePiece tokenizer in Python (the independent reference the
library's tokenizer is checked against), and the model probe the tests run once per session in a subprocess.

Why a subprocess: one process measures everything once (the model's ~1 GB of float32 weights are never held by a
test worker), whatever BLAS the test process runs on (on MLX's bundled reference BLAS one forward pass of Gemma 3's
262144 x 640 output layer over a few hundred tokens takes minutes). The probe loads OpenBLAS before MLX
(`load_openblas_global`), as the apps do, loads Gemma 3 once, measures everything the tests check and writes it as
JSON:

    python tests/apps/models/_gemma3_helpers.py OUT.json
"""
from __future__ import annotations

import heapq
import json
import math
import sys
import time
from typing import Dict, List, Sequence

BOS_ID = 2
# A plain-text prompt the base model continues with a fact any working model of its size knows.
PROMPT = "Water boils at a temperature of"
GREEDY_TOKENS = 10
CLI_TOKENS = 4
PPL_TOKENS = 384  # the first tokens of the Debian Reference text, after <bos>
PPL_CHARS = 4000  # the text they come from (tokenizing the whole corpus takes longer than this)
F16_TEXT = "The Linux kernel schedules"
# The tokenizer's test strings: unicode, digits, whitespace runs, newlines, tabs, code, user-defined pieces (HTML
# tags, newline / space / tab runs), a control token's text, characters outside the vocabulary (byte fallback).
TOKENIZER_TEXTS = (
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと中文字符，한국어 문장",
    "Ünïcödé café naïve résumé Ελληνικά русский עברית العربية",
    "emoji 🤖🎉 👍🏽 👨‍👩‍👧 flags 🇫🇷🇯🇵",
    "digits 1234567890 3.14159 -42 1e-9 2024-06-01 0x1F",
    "a  b   c    d         e",
    "   leading and trailing   ",
    "line1\nline2\n\n\nline3\r\nline4\n",
    "\ttab\t\tx \t mixed\t \n",
    "def f(x):\n    return {k: v ** 2 for k, v in x.items()}  # squares\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] << 2;\n}",
    "https://example.com/path?q=1&r=%20x#frag user@example.org",
    "<b>bold</b> <code>x</code> <table><tr><td>1</td></tr></table>",
    "<start_of_turn>user\nhi<end_of_turn>",
    "rare 𠀀𪚥 \ue000 \u200b\u00a0 \x00\x7f",
    "",
    " ",
    "\n",
)
FUZZ_ALPHABET = ("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 \n\t.,;:!?()[]{}<>/'\"-_=+*&^%$#@~`|\\"
                 "éèàüöñçßøåæœ日本語中文字符한국어русскийελληνικάעבריתالعربية🤖🎉👍🏽🇫🇷\u200b\u00a0😀")


def fuzz_texts(n: int = 300, seed: int = 0) -> list:
    """``n`` random strings of up to 60 characters of `FUZZ_ALPHABET` (seeded: the same every run)."""
    import random

    rng = random.Random(seed)
    return ["".join(rng.choice(FUZZ_ALPHABET) for _ in range(rng.randint(0, 60))) for _ in range(n)]


# --------------------------------------------------------------------------- llama.cpp's SPM tokenizer, in Python
def spm_reference(text: str, vocab: Dict[str, int], scores: Sequence[float], specials: Sequence[str],
                  add_bos: bool = True) -> List[int]:
    """Token ids of ``text`` as llama.cpp's ``llm_tokenizer_spm`` gives them (written from its algorithm, sharing no
    code with the library).

    1. ``tokenizer_st_partition``: every special text (control and user-defined pieces; ``specials`` longest first)
       is cut out of the text, where it stands, as its own token.
    2. Each remaining fragment: spaces -> U+2581, split into UTF-8 characters; again and again merge the adjacent
       pair whose joined text is in the vocabulary with the highest score (the leftmost on a tie).
    3. A final symbol outside the vocabulary becomes its UTF-8 bytes as ``<0xXX>`` tokens (byte fallback).
    """
    frags = [(text, False)]
    for sp in specials:
        if not any(not is_sp and sp in f for f, is_sp in frags):
            continue
        out = []
        for f, is_sp in frags:
            if is_sp or sp not in f:
                out.append((f, is_sp))
                continue
            for j, part in enumerate(f.split(sp)):
                if j:
                    out.append((sp, True))
                if part:
                    out.append((part, False))
        frags = out
    ids = [BOS_ID] if add_bos else []
    for f, is_sp in frags:
        ids += [vocab[f]] if is_sp else _spm_fragment(f.replace(" ", "\u2581"), vocab, scores)
    return ids


def _spm_fragment(text: str, vocab: Dict[str, int], scores: Sequence[float]) -> List[int]:
    sym: List = list(text)  # a symbol's text; None once merged into its left neighbour
    prev, nxt = list(range(-1, len(sym) - 1)), list(range(1, len(sym) + 1))
    queue: list = []

    def push(left: int, right: int) -> None:
        if left < 0 or right >= len(sym):
            return
        joined = sym[left] + sym[right]
        i = vocab.get(joined)
        if i is not None:
            heapq.heappush(queue, (-scores[i], left, right, joined))

    for i in range(len(sym) - 1):
        push(i, i + 1)
    while queue:
        _, left, right, joined = heapq.heappop(queue)
        if sym[left] is None or sym[right] is None or nxt[left] != right or sym[left] + sym[right] != joined:
            continue  # stale: one side was merged since
        sym[left], sym[right] = joined, None
        nxt[left] = nxt[right]
        if nxt[right] < len(sym):
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    ids, i = [], 0
    while i < len(sym):
        s = sym[i]
        ids += [vocab[s]] if s in vocab else [vocab["<0x%02X>" % b] for b in s.encode("utf-8")]
        i = nxt[i]
    return ids


def reference_vocab(meta) -> tuple:
    """(vocab, scores, specials longest first) from GGUF tokenizer metadata, for `spm_reference`."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    specials = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)
    return {t: i for i, t in enumerate(tokens)}, [float(s) for s in meta["tokenizer.ggml.scores"]], specials


# --------------------------------------------------------------------------- the model probe (its own process)
def _timed(results: dict, name: str, start: float) -> None:
    results.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 2)


def probe() -> dict:
    """Load Gemma 3 once and measure what the tests check (see the module docstring)."""
    from veloxquant_mlx.apps.blas import load_openblas_global, loaded_blas

    load_openblas_global()  # before MLX is imported (by the imports below)
    from mlx_lm import generate

    import veloxquant_mlx
    from veloxquant_mlx.apps.eval.corpus import corpus_text
    from veloxquant_mlx.apps.eval.perplexity import perplexity_full_forward
    from veloxquant_mlx.apps.models import load_model, max_context

    r: dict = {}
    t = time.perf_counter()
    model, tok = load_model("gemma3-270m")
    _timed(r, "load", t)
    r["blas"] = loaded_blas()
    a = model.args
    r["args"] = {k: getattr(a, k) for k in ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "sliding_window",
                                            "sliding_window_pattern", "rope_theta", "rope_local_base_freq",
                                            "query_pre_attn_scalar", "vocab_size", "max_position_embeddings")}
    r["sliding"] = [bool(layer.self_attn.is_sliding) for layer in model.layers]
    r["rope_bases"] = [float(layer.self_attn.rope.base) for layer in model.layers]
    r["tied"] = bool(model.tie_word_embeddings) and "lm_head" not in model
    r["weight_dtype"] = str(model.layers[0].self_attn.q_proj.weight.dtype)
    r["max_context"] = max_context(model)
    r["tokenizer"] = {"class": type(tok).__name__, "has_chat_template": bool(tok.has_chat_template),
                      "bos_token_id": tok.bos_token_id, "eos_token_ids": sorted(tok.eos_token_ids)}
    texts = list(TOKENIZER_TEXTS) + fuzz_texts()
    encoded = [list(tok.encode(text)) for text in texts]
    r["encoded"] = {"texts": texts, "ids": encoded, "decoded": [tok.decode(ids[1:]) for ids in encoded]}

    t = time.perf_counter()
    text = generate(model, tok, PROMPT, max_tokens=GREEDY_TOKENS)
    r["greedy"] = {"prompt": PROMPT, "text": text, "ids": list(tok.encode(text, add_special_tokens=False))}
    _timed(r, "greedy", t)

    t = time.perf_counter()
    ids = tok.encode(corpus_text("debian-reference")[:PPL_CHARS], add_special_tokens=False)[:PPL_TOKENS]
    assert len(ids) == PPL_TOKENS, f"{PPL_CHARS} characters hold fewer than {PPL_TOKENS} tokens"
    r["ppl"] = {"tokens": PPL_TOKENS, "value": perplexity_full_forward(model, [BOS_ID] + ids, PPL_TOKENS)}
    _timed(r, "ppl", t)

    # enable(model): the caches it makes (no forward pass), then `veloxquant generate` on them through the CLI
    from veloxquant_mlx.apps.eval.corpus import text_prefix
    r["ppl"]["text_prefix"] = list(text_prefix(tok))  # what every evaluation window starts with
    import warnings
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        veloxquant_mlx.enable(model)
    try:
        caches = veloxquant_mlx.make_prompt_cache(model)
        r["enabled"] = {"options": repr(veloxquant_mlx.enabled_options(model)),
                        "caches": [type(c).__name__ for c in caches],
                        "max_size": [getattr(c, "max_size", None) for c in caches],
                        "bits": [[c.options.k_bits, c.options.value_bits] for c in caches],
                        "said": [str(w.message) for w in said]}
    finally:
        veloxquant_mlx.disable(model)
    t = time.perf_counter()
    r["cli"] = _cli_generate(model, tok)
    _timed(r, "cli", t)

    t = time.perf_counter()
    r["half"] = _half_precision(model, tok)
    _timed(r, "half", t)
    return r


def _cli_generate(model, tok) -> dict:
    """``veloxquant generate --model gemma3-270m`` (default preset: `enable(model)`'s compressed caches, attention on
    their codes) through the CLI's code, on the model already loaded; records the caches mlx_lm built."""
    import contextlib
    import io

    from veloxquant_mlx.apps.cli import common, main

    mlx_generate = sys.modules["mlx_lm.generate"]  # the module (``mlx_lm.generate`` the name is its function)
    made = []
    make = mlx_generate.make_prompt_cache  # what its generate_step calls; `enable` routes it to our caches

    def recording(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    loaded = common.load_model
    common.load_model = lambda name, quantized=False: (model, tok) if name == "gemma3-270m" else loaded(name, quantized)
    mlx_generate.make_prompt_cache = recording
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["generate", "--model", "gemma3-270m", "--prompt", PROMPT, "--max-tokens", str(CLI_TOKENS)])
    finally:
        common.load_model = loaded
        mlx_generate.make_prompt_cache = make
    caches = made[-1] if made else []
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()[-2000:],
            "prompt_tokens": len(tok.encode(PROMPT)), "caches": [type(c).__name__ for c in caches],
            "offset": [int(c.offset) for c in caches]}


def _half_precision(model, tok) -> dict:
    """Logits of `F16_TEXT` with float32 weights against bfloat16 and float16 ones (last: it casts the model), and
    the largest entry of the float32 residual stream (float16 holds at most 65504)."""
    import mlx.core as mx

    x = mx.array([tok.encode(F16_TEXT)])
    h = model.model.embed_tokens(x) * (model.args.hidden_size ** 0.5)
    residual = []
    for layer in model.layers:
        h = layer(h, "causal", None)
        residual.append(mx.abs(h).max(axis=(0, 2)))  # per position
    residual = mx.stack(residual).max(axis=0)
    ref = model(x)[0].astype(mx.float32)
    mx.eval(ref, residual)
    out = {"positions": int(x.shape[1]), "max_abs_logit": mx.abs(ref).max().item(),
           "residual_max_by_position": [round(v, 1) for v in residual.tolist()]}
    for dtype in (mx.bfloat16, mx.float16):
        model.set_dtype(dtype)
        half = model(x)[0].astype(mx.float32)
        mx.eval(half)
        out[str(dtype).rsplit(".", 1)[-1]] = {
            "top1_agreement": mx.mean(mx.argmax(ref, -1) == mx.argmax(half, -1)).item(),
            "max_abs_diff": mx.abs(ref - half).max().item(), "finite": bool(mx.all(mx.isfinite(half)).item())}
    return out


if __name__ == "__main__":
    start = time.perf_counter()
    result = probe()
    result["seconds"]["total"] = round(time.perf_counter() - start, 2)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["seconds"]), file=sys.stderr)
    sys.exit(0 if math.isfinite(result["ppl"]["value"]) else 1)
