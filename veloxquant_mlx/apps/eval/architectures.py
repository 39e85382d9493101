"""Every architecture the installed mlx_lm ships, checked with compressed caches on a tiny random model of it.

For each model type (`veloxquant_mlx.apps.eval.tiny_configs`): a prompt in two chunks, then teacher-forced decode steps,
through the caches mlx_lm makes for the model (``make_prompt_cache(model)``, as ``generate`` does):
- exact storage (``enable(model, codec="float16", k_bits=16, v_bits=16)``): in float32 the logits must be those of
  mlx_lm's own caches holding the same float16-rounded keys and values; in float16 / bfloat16 as close to the same
  weights run in float32 as mlx_lm's own cache in that dtype is: only the plumbing (routing, shared layers,
  latents, windows) is tested;
- the default configuration (``enable(model)``): it runs, every logit is finite, ``batch_generate`` (mlx_lm's
  BatchGenerator: merge, left padding, extract) runs wherever mlx_lm's own caches batch the model, and the report
  says which caches hold codes, which hold recurrent state and which attention caches stay plain, with the reason.

``python -m veloxquant_mlx.apps.eval.architectures [--dtype float32] [--markdown FILE] [--json FILE] [NAME ...]`` prints
the table (the README's "Supported models" comes from it); tests/apps/eval/test_architectures.py asserts it.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import batch_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from veloxquant_mlx.apps.eval.tiny_configs import CONFIGS, METAL_ONLY, NEEDS
from veloxquant_mlx.integration.builder import cache_report
from veloxquant_mlx.integration.enabling import disable, enable

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# The largest logit error exact storage may add, relative to the logits' spread, in each model dtype (or the error
# the float16 rounding of the keys and values itself causes, where a model amplifies it more: gemma4's softcapped
# logits); wrong plumbing measured 0.3-1.9.
TOLERANCE = {"float32": 0.01, "float16": 0.05, "bfloat16": 0.1}
# In float16 / bfloat16 the reference is the same weights in float32: exact storage may be off from it by at most this
# times what mlx_lm's own cache in that dtype is (measured up to 1.26x in float16 and 1.40x in bfloat16: gemma3n,
# whose random tiny weights make bfloat16 itself 0.37 of the spread off).
HALF_MARGIN = 1.5
PROMPT, CHUNK, STEPS, VOCAB_USED = 80, 48, 8, 100
EXACT = dict(codec="float16", k_bits=16, v_bits=16)


@dataclass
class Result:
    """One architecture's check. ``status``: compressed / partly (some attention caches left plain) / plain (every
    attention cache left plain) / no attention (recurrent state only) / not run / wrong / crash."""
    name: str
    dtype: str
    status: str = "crash"
    compressed: int = 0
    state: int = 0
    plain: List[str] = field(default_factory=list)
    exact_error: Optional[float] = None  # ours (exact storage) against mlx_lm's caches of float16-rounded tokens
    rounding_error: Optional[float] = None  # mlx_lm's plain caches against the same: what the rounding itself does
    default_finite: Optional[bool] = None
    batch: str = ""  # batch_generate with the default: "ok", or why mlx_lm's own caches cannot batch the model
    batch_error: Optional[float] = None  # `batch_rows_error` with exact storage (float32 only)
    plain_batch_error: Optional[float] = None  # the same with mlx_lm's own caches (afm7's batch is off there too)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("compressed", "partly", "plain", "no attention", "not run")


def build(name: str, dtype=mx.float32, seed: int = 0, upcast: bool = False):
    """The tiny random ``name`` model (``mlx_lm.models.<name>``) in ``dtype`` (``upcast``: its ``dtype`` weights
    held in float32, the same numbers)."""
    if name not in CONFIGS:
        raise ValueError(f"no tiny configuration for {name!r}; known: {', '.join(CONFIGS)}")
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(dict(CONFIGS[name])))
    if dtype != mx.float32:
        model.update(tree_map(lambda p: p.astype(dtype).astype(mx.float32 if upcast else dtype)
                              if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def tokens(seed: int = 1) -> mx.array:
    """``(1, PROMPT + STEPS)`` token ids below `VOCAB_USED`."""
    return mx.random.randint(0, VOCAB_USED, (1, PROMPT + STEPS), key=mx.random.key(seed))


def run(model, caches, toks: mx.array) -> mx.array:
    """Logits ``(PROMPT + STEPS, vocab)`` float32: the prompt in two chunks, then one token per step."""
    outs = [model(toks[:, :CHUNK], cache=caches), model(toks[:, CHUNK:PROMPT], cache=caches)]
    for t in range(PROMPT, PROMPT + STEPS):
        outs.append(model(toks[:, t:t + 1], cache=caches))
    out = mx.concatenate([o[0].astype(mx.float32) for o in outs], axis=0)
    mx.eval(out)
    return out


def _flat(caches) -> list:
    out = []
    for c in caches:
        inner = getattr(c, "caches", None)
        out.extend(_flat(inner) if inner is not None else [c])
    return out


def _rounded_to_float16(caches, which):
    """mlx_lm's own ``caches`` storing what exact (float16) storage stores: the keys and values of the caches
    ``which`` (positions in the flattened list: those we compress) rounded to float16. Against them only the
    plumbing differs (a MoE router or a sparse-attention indexer may flip on the rounding alone: phimoe)."""
    for i, c in enumerate(_flat(caches)):
        if i in which and callable(getattr(c, "update_and_fetch", None)):
            fetch = c.update_and_fetch

            def rounded(keys, values, *a, _fetch=fetch, **k):
                r = [x.astype(mx.float16).astype(x.dtype) if mx.issubdtype(x.dtype, mx.floating) else x
                     for x in (keys, values)]
                return _fetch(*r, *a, **k)
            c.update_and_fetch = rounded
    return caches


def _enabled_run(model, toks, **options):
    """(logits, `cache_report`, flattened positions of the compressed caches) with ``enable(model, **options)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the coverage line: the report below says the same)
        enable(model, **options)
    try:
        caches = make_prompt_cache(model)
        report = cache_report(caches)
        return run(model, caches, toks), report, {i for i, (k, _) in enumerate(report) if k == "compressed"}
    finally:
        disable(model)


class IdTokenizer:
    """Just enough of a tokenizer for mlx_lm's TokenizerWrapper (``batch_generate`` on tiny random models): token i
    is the text '<i>', no files, no network."""
    eos_token_id, bos_token, chat_template, all_special_ids = None, None, None, []

    def __init__(self, vocab: int = 128):
        self.vocab = vocab

    def get_vocab(self):
        return {f"<{i}>": i for i in range(self.vocab)}

    def apply_chat_template(self, messages, **kwargs):
        raise NotImplementedError("token ids only")

    def encode(self, text, add_special_tokens=True):
        return [int(t) if t.isdigit() else 0 for t in text.split()]

    def decode(self, ids, **kwargs):
        return "".join(f"<{i}>" for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [f"<{i}>" for i in ids] if isinstance(ids, list) else f"<{ids}>"


BATCH_PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7])  # two lengths: left padding, rows finishing apart


def _batch(model) -> str:
    """``batch_generate`` (mlx_lm's BatchGenerator: merge, padding, extract) with the default configuration:
    "ok", or why mlx_lm's own caches cannot batch this model. Raises when ours fail where mlx_lm's do not."""
    tokenizer = TokenizerWrapper(IdTokenizer())
    try:
        batch_generate(model, tokenizer, list(BATCH_PROMPTS), max_tokens=4, verbose=False)
    except Exception as e:  # noqa: BLE001 - mlx_lm's own limit (ChunkedKVCache, say)
        return f"mlx_lm's own caches do not batch it: {type(e).__name__}: {e}"[:200]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the coverage line; an MLA model's "uncompressed while batched")
        enable(model)
        try:
            out = batch_generate(model, tokenizer, list(BATCH_PROMPTS), max_tokens=4, verbose=False)
        finally:
            disable(model)
    if len(out.texts) != len(BATCH_PROMPTS) or not all(out.texts):
        raise RuntimeError(f"batch_generate gave {out.texts!r}")
    return "ok"


def batch_rows_error(model, toks, **options) -> float:
    """Two sequences (40 and 25 prompt tokens) prefilled alone, merged as mlx_lm's BatchGenerator merges them
    (``type(c).merge``), then 4 decode steps: the batch's logits against each sequence decoding alone, relative to
    their spread (0 when rows behave as alone). ``options``: enable the model with them first; none: mlx_lm's own."""
    if options:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(model, **options)
    try:
        singles = []
        for n in (40, 25):
            caches = make_prompt_cache(model)
            model(toks[:, :n], cache=caches)
            singles.append(caches)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (an MLA model's "uncompressed while batched")
            batch = [type(a).merge([copy.deepcopy(a), copy.deepcopy(b)]) for a, b in zip(*singles)]
        worst = 0.0
        for t in range(50, 54):
            step = toks[:, t:t + 1]
            alone = mx.stack([model(step, cache=c)[0, -1] for c in singles]).astype(mx.float32)
            both = model(mx.concatenate([step, step], axis=0), cache=batch)[:, -1].astype(mx.float32)
            worst = max(worst, float(mx.max(mx.abs(both - alone)).item()) / (float(mx.std(alone).item()) or 1.0))
        return worst
    finally:
        if options:
            disable(model)


def check(name: str, dtype: str = "float32") -> Result:
    """`Result` of ``name`` in ``dtype`` (never raises for the model's sake: a crash is a status)."""
    result = Result(name, dtype)
    if name in METAL_ONLY and not mx.metal.is_available():
        result.status, result.detail = "not run", f"needs {NEEDS[name]}"
        return result
    try:
        model = build(name, DTYPES[dtype])
    except ImportError as e:
        result.status, result.detail = "not run", f"needs {NEEDS.get(name, e)}"
        return result
    toks = tokens()
    try:
        plain = run(model, make_prompt_cache(model), toks)
    except Exception as e:  # noqa: BLE001 - mlx_lm itself cannot run it here: not ours to judge
        result.status, result.detail = "not run", f"mlx_lm's own caches fail here: {type(e).__name__}: {e}"[:300]
        return result
    stage = "exact storage"
    try:
        got, report, ours = _enabled_run(model, toks, **EXACT)
        stage = "plain run"
        if dtype == "float32":  # against mlx_lm's caches holding the same float16-rounded keys and values
            ref = run(model, _rounded_to_float16(make_prompt_cache(model), ours), toks)
        else:  # against the same weights in float32: no worse than mlx_lm's own cache in this dtype
            ref = run(build(name, DTYPES[dtype], upcast=True), make_prompt_cache(model), toks)
        finite = mx.isfinite(ref)  # (phi3small sets some logits to -inf: they must match too)
        spread = float(mx.std(mx.where(finite, ref, 0)).item()) or 1.0

        def error(a):
            return float(mx.max(mx.where(finite, mx.abs(a - ref), mx.where(a == ref, 0, mx.inf))).item()) / spread
        result.exact_error, result.rounding_error = error(got), error(plain)
        stage = "default configuration"
        default, report, _ = _enabled_run(model, toks)
        result.default_finite = bool(mx.all(mx.isfinite(default) | ~finite).item())
        stage = "batch_generate"
        result.batch = _batch(model)
        if result.batch == "ok" and dtype == "float32":
            stage = "batch rows"
            result.batch_error = batch_rows_error(model, toks, **EXACT)
            result.plain_batch_error = batch_rows_error(model, toks)
    except Exception as e:  # noqa: BLE001 - reported as the architecture's status
        result.detail = f"{stage}: {type(e).__name__}: {e}"[:300]
        return result
    result.compressed = sum(k == "compressed" for k, _ in report)
    result.state = sum(k == "state" for k, _ in report)
    result.plain = [what for k, what in report if k == "plain"]
    if not (result.exact_error <= max(TOLERANCE[dtype], HALF_MARGIN * result.rounding_error if dtype != "float32"
                                      else result.rounding_error)):
        result.status = "wrong"
        result.detail = f"exact storage: logits off by {result.exact_error:.3g} of their spread"
    elif result.batch_error is not None and \
            result.batch_error > max(TOLERANCE[dtype], 1.5 * result.plain_batch_error):
        result.status = "wrong"
        result.detail = f"batched rows: logits off their decoding alone by {result.batch_error:.3g} of their spread"
    elif not result.default_finite:
        result.status = "wrong"
        result.detail = "default configuration: non-finite logits"
    else:
        result.status = ("partly" if result.plain else "compressed") if result.compressed else \
            ("plain" if result.plain else "no attention")
    return result


def describe(r: Result) -> str:
    """The table's "what is compressed" cell."""
    if r.status in ("not run", "crash", "wrong"):
        return r.detail
    parts = [f"{r.compressed} attention caches compressed"] if r.compressed else []
    if r.state:
        parts.append(f"{r.state} recurrent-state caches kept as they are")
    parts.extend(f"1 left plain: {p}" if r.plain.count(p) == 1 else f"{r.plain.count(p)} left plain: {p}"
                 for p in dict.fromkeys(r.plain))
    return "; ".join(parts) or "no cache"


def markdown(results: List[Result]) -> str:
    lines = [f"Tiny random models in {results[0].dtype if results else 'float32'} (`python -m "
             "veloxquant_mlx.apps.eval.architectures --markdown FILE`). Errors are relative to the logits' spread: exact "
             "storage against mlx_lm's caches of the same float16-rounded tokens (in brackets: the rounding's own "
             "effect); batched rows against each sequence alone (in brackets: mlx_lm's own batch).", "",
             "| architecture | status | what is compressed | exact-storage error | batch_generate | batched rows |",
             "|---|---|---|---|---|---|"]
    for r in results:
        err = "" if r.exact_error is None else f"{r.exact_error:.1e} ({r.rounding_error:.1e})"
        rows = "" if r.batch_error is None else f"{r.batch_error:.1e} ({r.plain_batch_error:.1e})"
        lines.append(f"| `{r.name}` | {r.status} | {describe(r)} | {err} | {r.batch} | {rows} |")
    return "\n".join(lines) + "\n"


def summary_markdown(results: List[Result]) -> str:
    """The README's "Supported models" table: architectures grouped by what happens to their caches."""
    def names(rs):
        return ", ".join(f"`{r.name}`" for r in sorted(rs, key=lambda r: r.name.lower()))
    full = [r for r in results if r.status == "compressed"]
    hybrid = [r for r in full if r.state]
    rows = [("every attention cache compressed", str(len(full) - len(hybrid)),
             names([r for r in full if not r.state])),
            ("hybrids: every attention cache compressed, SSM / linear-attention state kept", str(len(hybrid)),
             names(hybrid))]
    groups: Dict[str, List[Result]] = {}
    for r in results:
        if r.status in ("partly", "plain"):
            reasons = "; ".join(dict.fromkeys(r.plain))
            groups.setdefault(f"{r.status}: attention caches left plain: {reasons}", []).append(r)
        elif r.status == "no attention":
            groups.setdefault("nothing to compress (recurrent state only): `enable` says so and changes nothing",
                              []).append(r)
        elif r.status != "compressed":
            groups.setdefault(f"{r.status}: {r.detail}", []).append(r)
    order = ("partly", "plain", "nothing", "not run")  # (then anything else: wrong, crash)
    rank = {w: next((i for i, o in enumerate(order) if w.startswith(o)), len(order)) for w in groups}
    rows += [(what, str(len(groups[what])), names(groups[what])) for what in sorted(groups, key=rank.get)]
    for name in sorted(set(NEEDS) - set(CONFIGS) - {r.name for r in results}):
        rows.append((f"not run: needs {NEEDS[name]}", "1", f"`{name}`"))
    lines = ["| what happens | models | architectures (`model_type`) |", "|---|---|---|"]
    lines += [f"| {what} | {n} | {who} |" for what, n, who in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="architectures (default: every one)")
    p.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    p.add_argument("--markdown", help="write the table here")
    p.add_argument("--summary", help="write the grouped table (the README's) here")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    unknown = [n for n in a.names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown architectures {unknown}; known: {', '.join(CONFIGS)}")
    results = []
    for name in a.names or list(CONFIGS):
        results.append(check(name, a.dtype))
        r = results[-1]
        print(f"{r.name:24s} {r.status:10s} {describe(r)}", flush=True)
    table = markdown(results)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(table)
    if a.summary:
        with open(a.summary, "w") as f:
            f.write(summary_markdown(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    bad = [r.name for r in results if not r.ok]
    print(f"{len(results) - len(bad)} of {len(results)} architectures ok" + (f"; not ok: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
