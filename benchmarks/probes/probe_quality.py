"""Quality probe for KV-cache quantization recipes on SmolLM2-135M (a measuring instrument, not the product).

One command (from the repository root):

    python -m benchmarks.probes.probe_quality                 # SCREEN_DEFAULT screen + E2E_DEFAULT at 512 x 2 windows
    python -m benchmarks.probes.probe_quality --stage screen  # layer-local proxy only (seconds per config)
    python -m benchmarks.probes.probe_quality --stage e2e --configs NAME,NAME --context 2048 --windows 1
    python -m benchmarks.probes.probe_quality --stage needle --configs NAME --needle-lengths 1024,2048,4096

Results merge into results/probe_quality.json (screen / e2e[ctx<C>_w<W>] / needle / configs with bits).
A config name is its recipe (``parse_config``): ``K<kb>V<vb>`` then options joined by "-":
``kw=`` key transform (``dfu_<qp>_<kp>``: untied diagonal weights from W_q and online key moments,
``calu_<qp>_<kp>``: same from a calibration pass, ``diag``/``diag_df``: RoPE-pair-tied, ``full``: geometric-mean
matrix), ``vw=o_diag|o_full`` (value weights from W_o), ``s=`` exact sink tokens, ``w=`` exact recent window,
``o=<n>x<bits>`` key outlier channels, ``c=affine`` (``g=`` group), ``nc=1`` no centring,
``kl=``/``vl=`` per-layer bits (``"1:5;20.29:2"``). Bits 0 = stream left exact.

Keys/values are quantized then dequantized on insertion into an mlx_lm ``KVCache`` subclass (``ProbeCache``)
through the project's own codecs (``LloydMaxCodec`` = centring + outlier split + rotation/Lloyd-Max, or
``AffineRotatedCodec`` = centring + rotation + ``mx.quantize``), optionally wrapped by a channel transform
from ``benchmarks/_key_weighting.py`` (query-aware key weights, output-aware value weights).

Two measurements:
* screen: exact per-layer q/k/v of one window are captured once; each config quantizes k/v per layer and
  the causal attention output error ||o_hat - o||^2 / ||o||^2 is summed over layers (no error propagation;
  for ranking only).
* e2e: the model runs with every config's cache in lockstep with the plain cache, chunked prefill (256);
  KL(ref || test) nats/token, top-1 agreement and perplexity, on windows [i*ctx, (i+1)*ctx).

Bits per coordinate are computed from what a cache would store (every byte counted) at 512 and 4096 tokens:
codes, per-vector norms (bf16) or affine scales+biases (fp16), the per-head mean (fp32), outlier
permutation (uint8 per channel), channel weights (fp16 per RoPE pair; 0 when derived from model weights),
full transforms (fp16 d x d per head), exact sink/window tokens (fp16), averaged over K and V.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from typing import Dict, List

from veloxquant_mlx.blas import ensure_openblas  # (before mlx is imported)

from benchmarks import _common
# The recipes (a config, the name that spells it, the default lists, the bits accounting) live in _quality_recipes.py;
# imported here so that probe_quality.NAME stays what it was.
from benchmarks.probes._quality_recipes import (  # noqa: F401
    _KEYS, C4, D4, E2E_DEFAULT, EXACT_BITS, NORM_BITS, SCREEN_DEFAULT, Config, _layer_bits, effective_bits, mean_bits,
    parse_config, stream_bits,
)

CAL_START = 100_000  # calibration text: far from every evaluation window
CAL_LEN = 512


# -- model statistics -----------------------------------------------------------------------------------
class ModelStats:
    """Calibration statistics per layer (from CAL text) and weight-derived matrices."""

    def __init__(self, model, tokens):
        import mlx.core as mx

        from benchmarks import _key_weighting as kw

        self.n_layers = len(model.layers)
        a = model.args
        self.hq, self.hkv, self.d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        cap = capture_qkv(model, tokens[CAL_START : CAL_START + CAL_LEN])
        self.q2, self.k2, self.sq, self.sk = [], [], [], []
        rep = self.hq // self.hkv
        for q, k, _ in cap:
            self.q2.append(kw.query_second_moments(q, self.hkv))
            kc = k - mx.mean(k, axis=2, keepdims=True)
            self.k2.append(mx.mean(kc * kc, axis=(0, 2)))
            qg = q[0].reshape(self.hkv, rep, q.shape[2], self.d).reshape(self.hkv, rep * q.shape[2], self.d)
            self.sq.append(mx.swapaxes(qg, -1, -2) @ qg / qg.shape[1])
            self.sk.append(mx.swapaxes(kc[0], -1, -2) @ kc[0] / kc.shape[2])
        self.wq2, self.gram_o = [], []
        for layer in model.layers:
            at = layer.self_attn
            self.wq2.append(kw.query_second_moments_from_weights(
                at.q_proj.weight, self.hkv, self.d, layer.input_layernorm.weight))
            wo = at.o_proj.weight.astype(mx.float32)  # (hidden, Hq*d)
            blocks = wo.reshape(wo.shape[0], self.hq, self.d).transpose(1, 0, 2)  # (Hq, hidden, d)
            g = mx.swapaxes(blocks, -1, -2) @ blocks  # (Hq, d, d)
            self.gram_o.append(mx.sum(g.reshape(self.hkv, rep, self.d, self.d), axis=1))
        mx.eval(self.q2, self.k2, self.sq, self.sk, self.wq2, self.gram_o)


def capture_qkv(model, tokens, chunk=256):
    """Exact post-RoPE queries (1, Hq, T, d), keys and values (1, Hkv, T, d) of every layer."""
    import mlx.core as mx
    import mlx_lm.models.llama as llama
    from mlx_lm.models.cache import KVCache

    caches = [KVCache() for _ in model.layers]
    for i, c in enumerate(caches):
        c._probe_layer = i
    qs: Dict[int, list] = {i: [] for i in range(len(caches))}
    orig = llama.scaled_dot_product_attention

    def spy(queries, keys, values, cache=None, **kw):
        qs[cache._probe_layer].append(queries)
        return orig(queries, keys, values, cache=cache, **kw)

    llama.scaled_dot_product_attention = spy
    try:
        x = mx.array(list(tokens), dtype=mx.int32)[None]
        for s in range(0, x.shape[1], chunk):
            mx.eval(model.model(x[:, s : s + chunk], caches))
    finally:
        llama.scaled_dot_product_attention = orig
    out = []
    for i, c in enumerate(caches):
        k, v = c.keys[:, :, : c.offset], c.values[:, :, : c.offset]
        out.append((mx.concatenate(qs[i], axis=2), k, v))
    mx.eval(out)
    return out


# -- streams and caches -----------------------------------------------------------------------------------
class ProbeStream:
    """Quantize-then-dequantize one stream of one layer: transform -> codec -> inverse transform."""

    def __init__(self, cfg: Config, which: str, layer: int, stats: ModelStats):
        self.cfg, self.which, self.layer, self.stats = cfg, which, layer, stats
        self.bits = (_layer_bits(cfg.kb, cfg.kb_layers, layer) if which == "k"
                     else _layer_bits(cfg.vb, cfg.vb_layers, layer))
        self.codec = None
        self.fwd = self.inv = None  # callables (B,H,T,d) -> (B,H,T,d)

    def _make_codec(self):
        d = self.stats.d
        if self.cfg.codec == "affine":
            from veloxquant_mlx.codecs import AffineRotatedCodec

            return AffineRotatedCodec(d, self.bits, self.cfg.group, center=self.cfg.center)
        from veloxquant_mlx.codecs import LloydMaxCodec

        n_out = self.cfg.k_out if self.which == "k" else 0
        return LloydMaxCodec("turboquant_mse", d, self.bits, n_outliers=n_out,
                            outlier_bits=self.cfg.k_out_bits, center=self.cfg.center)

    def _fit_transform(self, x):
        import mlx.core as mx

        from benchmarks import _key_weighting as kw

        st, L, tw = self.stats, self.layer, (self.cfg.kw if self.which == "k" else self.cfg.vw)
        xc = x - mx.mean(x, axis=2, keepdims=True)
        x2 = mx.mean(xc * xc, axis=(0, 2))  # (H, d) online moments from the first chunk
        w = a = None
        if tw == "none":
            return
        if tw == "diag":
            w = kw.channel_weights(st.q2[L], st.k2[L])
        elif tw == "diagu":
            w = kw.channel_weights(st.q2[L], st.k2[L], tie=False)
        elif tw == "diagu8":  # weaker exponents
            w = kw.channel_weights(st.q2[L], st.k2[L], q_power=0.125, k_power=0.125, tie=False)
        elif tw == "diag_dfu":
            w = kw.channel_weights(st.wq2[L], x2, tie=False)
        elif tw.startswith(("dfu_", "calu_")):  # "<source>_<q_power>_<k_power>", untied
            src, qp, kp = tw.split("_")
            qm, km = (st.wq2[L], x2) if src == "dfu" else (st.q2[L], st.k2[L])
            w = kw.channel_weights(qm, km, q_power=float(qp), k_power=float(kp), tie=False)
        elif tw == "diagq":
            w = kw.channel_weights(st.q2[L], None, q_power=0.5, k_power=0.0)
        elif tw == "diag_df":
            w = kw.channel_weights(st.wq2[L], x2)
        elif tw == "full":
            a, a_inv = kw.geometric_mean_transform(st.sq[L], st.sk[L])
        elif tw == "o_diag":
            g = mx.diagonal(st.gram_o[L], axis1=-2, axis2=-1)
            # values are not RoPE-rotated; tie nothing: use the plain diagonal optimum
            lw = 0.25 * mx.log(g + 1e-12) - 0.25 * mx.log(x2 + 1e-12)
            w = mx.exp(lw - mx.mean(lw, axis=-1, keepdims=True))
        elif tw == "o_full":
            sv = mx.swapaxes(xc[0], -1, -2) @ xc[0] / xc.shape[2]
            a, a_inv = kw.geometric_mean_transform(st.gram_o[L], sv)
        else:
            raise ValueError(f"unknown transform {tw!r}")
        if w is not None:
            self.fwd = lambda t: kw.apply_channel_weights(t, w)
            self.inv = lambda t: kw.unapply_channel_weights(t, w)
        else:
            self.fwd = lambda t: kw.apply_transform(t, a)
            self.inv = lambda t: kw.apply_transform(t, a_inv)

    def roundtrip(self, x):
        import mlx.core as mx

        if self.bits == 0:
            return x
        if self.cfg.codec == "affine" and self.bits == 1:
            raise ValueError("affine codec has no 1-bit mode")
        xf = x.astype(mx.float32)
        if self.codec is None:
            self._fit_transform(xf)
            self.codec = self._make_codec()
            self.codec.fit(self.fwd(xf) if self.fwd else xf)
        t = self.fwd(xf) if self.fwd else xf
        y = self.codec.decode(self.codec.encode(t), mx.float32)
        return (self.inv(y) if self.inv else y).astype(x.dtype)


def make_probe_cache_cls():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    class ProbeCache(KVCache):
        """KVCache that stores dequantized keys/values (exact sinks / recent window as fp16)."""

        def __init__(self, cfg: Config, layer: int, stats: ModelStats):
            super().__init__()
            self.cfg = cfg
            self.ks, self.vs = ProbeStream(cfg, "k", layer, stats), ProbeStream(cfg, "v", layer, stats)
            self.k_ex = self.v_ex = self.k_q = self.v_q = None

        def update_and_fetch(self, keys, values):
            cat = lambda a, b: b if a is None else mx.concatenate([a, b], axis=2)  # noqa: E731
            self.k_ex = cat(self.k_ex, keys.astype(mx.float16).astype(keys.dtype))
            self.v_ex = cat(self.v_ex, values.astype(mx.float16).astype(values.dtype))
            self.k_q = cat(self.k_q, self.ks.roundtrip(keys))
            self.v_q = cat(self.v_q, self.vs.roundtrip(values))
            self.offset += keys.shape[2]
            n = self.offset
            s, w = self.cfg.sinks, self.cfg.window
            if s == 0 and w == 0:
                return self.k_q, self.v_q
            idx = mx.arange(n)
            exact = ((idx < s) | (idx >= n - w))[None, None, :, None]
            return mx.where(exact, self.k_ex, self.k_q), mx.where(exact, self.v_ex, self.v_q)

    return ProbeCache


# -- measurements ---------------------------------------------------------------------------------------------
def screen(cfgs: List[Config], cap, stats, fit_len=256) -> Dict[str, dict]:
    """Layer-local proxy: sum over layers of the relative causal attention output error."""
    import mlx.core as mx

    out = {}
    scale = stats.d ** -0.5
    rep = stats.hq // stats.hkv
    T = cap[0][1].shape[2]
    mask = mx.triu(mx.full((T, T), -mx.inf), k=1)
    refs = []
    for q, k, v in cap:
        kk, vv = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
        p = mx.softmax(q @ mx.swapaxes(kk, -1, -2) * scale + mask, axis=-1)
        refs.append((p, p @ vv))
    for cfg in cfgs:
        err, skl = 0.0, 0.0
        for L, (q, k, v) in enumerate(cap):
            ks, vs = ProbeStream(cfg, "k", L, stats), ProbeStream(cfg, "v", L, stats)
            ks.roundtrip(k[:, :, :fit_len])  # fit on the first chunk, as the cache would
            vs.roundtrip(v[:, :, :fit_len])
            kh, vh = ks.roundtrip(k), vs.roundtrip(v)
            if cfg.sinks:
                kh = mx.concatenate([k[:, :, : cfg.sinks], kh[:, :, cfg.sinks :]], axis=2)
                vh = mx.concatenate([v[:, :, : cfg.sinks], vh[:, :, cfg.sinks :]], axis=2)
            kk, vv = mx.repeat(kh, rep, axis=1), mx.repeat(vh, rep, axis=1)
            logits = q @ mx.swapaxes(kk, -1, -2) * scale + mask
            p = mx.softmax(logits, axis=-1)
            o = p @ vv
            pr, orf = refs[L]
            e = mx.sum((o - orf) ** 2) / mx.sum(orf ** 2)
            lp = mx.log(mx.maximum(p, 1e-30))
            kl = mx.sum(mx.where(pr > 0, pr * (mx.log(mx.maximum(pr, 1e-30)) - lp), 0.0)) / (q.shape[1] * T)
            mx.eval(e, kl)
            err += e.item()
            skl += kl.item()
        out[cfg.name] = {"attn_out_err": err, "attn_kl": skl}
    return out


def e2e(model, tokens, cfgs: List[Config], stats, context: int, n_windows: int, chunk=256) -> Dict[str, dict]:
    """Lockstep KL / top-1 / perplexity vs the plain cache; the windows run as one batch."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    Probe = make_probe_cache_cls()
    inp = mx.array([tokens[i * context : (i + 1) * context] for i in range(n_windows)], dtype=mx.int32)
    tgt = mx.array([tokens[i * context + 1 : (i + 1) * context + 1] for i in range(n_windows)], dtype=mx.int32)
    ref = [KVCache() for _ in model.layers]
    caches = {c.name: [Probe(c, i, stats) for i in range(len(model.layers))] for c in cfgs}
    acc = {c.name: [0.0, 0.0, 0] for c in cfgs}
    ref_nll, n = 0.0, 0
    for s in range(0, context, chunk):
        x, y = inp[:, s : s + chunk], tgt[:, s : s + chunk]
        rl = model(x, cache=ref)
        rl = rl - mx.logsumexp(rl, axis=-1, keepdims=True)
        r = -mx.take_along_axis(rl, y[..., None], axis=-1).sum()
        mx.eval(rl, r)
        ref_nll += r.item()
        for c in cfgs:
            lp = model(x, cache=caches[c.name])
            lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
            nll = -mx.take_along_axis(lp, y[..., None], axis=-1).sum()
            kl = (mx.exp(rl) * (rl - lp)).sum()
            ag = (mx.argmax(lp, axis=-1) == mx.argmax(rl, axis=-1)).sum()
            mx.eval(nll, kl, ag)
            a = acc[c.name]
            a[0] += nll.item(); a[1] += kl.item(); a[2] += int(ag.item())  # noqa: E702
        n += y.size
    ref_ppl = math.exp(ref_nll / n)
    res = {"_ref": {"ppl": ref_ppl, "context": context, "windows": n_windows, "tokens": n}}
    for c in cfgs:
        nll, kl, ag = acc[c.name]
        ppl = math.exp(nll / n)
        res[c.name] = {"ppl": ppl, "delta_ppl_pct": 100 * (ppl / ref_ppl - 1), "kl": kl / n, "top1": ag / n}
    return res


def fmt_table(rows: List[dict]) -> str:
    head = ["config", "K/V bits", "eff bits @512", "eff bits @4096", "ctx", "KL", "top-1", "Δppl %", "attn err (screen)",
            "attn KL (screen)"]

    def cells(r):
        f = lambda k, p: ("-" if r.get(k) is None else p.format(r[k]))  # noqa: E731
        return [r["name"], f"{r['kb']}/{r['vb']}", f"{r['bits512']:.3f}", f"{r['bits4096']:.3f}", r.get("ctx", "-"),
                f("kl", "{:.4f}"), f("top1", "{:.3f}"), f("delta_ppl_pct", "{:+.2f}"), f("attn_out_err", "{:.4f}"),
                f("attn_kl", "{:.4f}")]
    return _common.markdown_table(head, [cells(r) for r in rows])


def main(argv=None):
    ensure_openblas()
    p = _common.parser(__doc__)
    p.add_argument("--stage", choices=("screen", "e2e", "needle", "all"), default="all")
    p.add_argument("--needle-lengths", default="1024,2048,4096")
    p.add_argument("--configs", default="", help="comma-separated names (default: all for screen, finalists for e2e)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--windows", type=int, default=2)
    _common.add_out(p, "results/probe_quality.json", help="JSON merged into (default results/probe_quality.json)")
    args = p.parse_args(argv)

    import mlx.core as mx  # noqa: F401

    from veloxquant_mlx.eval.corpus import corpus_tokens
    from veloxquant_mlx.models.loader import load_model

    t0 = time.time()
    model, tok = load_model("smollm2")
    tokens = corpus_tokens(tok)
    stats = ModelStats(model, tokens)
    given = [n for n in args.configs.split(",") if n]
    cfgs = {n: parse_config(n) for n in (given or SCREEN_DEFAULT + E2E_DEFAULT)}
    names = given or (E2E_DEFAULT if args.stage in ("e2e", "needle") else SCREEN_DEFAULT)
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    results.setdefault("screen", {})
    results.setdefault("e2e", {})
    rows = []
    if args.stage in ("screen", "all"):
        cap = capture_qkv(model, tokens[:512])
        sc = screen([cfgs[n] for n in names], cap, stats)
        results["screen"].update(sc)
        for n in names:
            c = cfgs[n]
            rows.append(dict(name=n, kb=c.kb, vb=c.vb, bits512=effective_bits(c, 512),
                             bits4096=effective_bits(c, 4096), **sc[n]))
        print(fmt_table(rows), flush=True)
    if args.stage in ("e2e", "all"):
        if args.stage == "all" and not given:
            names = E2E_DEFAULT
        res = e2e(model, tokens, [cfgs[n] for n in names], stats, args.context, args.windows)
        key = f"ctx{args.context}_w{args.windows}"
        results["e2e"].setdefault(key, {}).update(res)
        rows = []
        for n in names:
            c = cfgs[n]
            rows.append(dict(name=n, kb=c.kb, vb=c.vb, bits512=effective_bits(c, 512),
                             bits4096=effective_bits(c, 4096), ctx=args.context,
                             attn_out_err=results["screen"].get(n, {}).get("attn_out_err"), **res[n]))
        print(f"reference ppl {res['_ref']['ppl']:.4f} ({res['_ref']['tokens']} tokens)")
        print(fmt_table(rows), flush=True)
    if args.stage == "needle":
        from veloxquant_mlx.eval.passkey import passkey_eval
        from veloxquant_mlx.eval.specs import CacheSpec

        Probe = make_probe_cache_cls()
        specs = [CacheSpec(n, (lambda c: lambda m: [Probe(c, i, stats) for i in range(len(m.layers))])(cfgs[n]))
                 for n in names]
        lengths = [int(x) for x in args.needle_lengths.split(",") if x]
        res = passkey_eval(model, tok, tokens, specs, lengths=lengths, progress=False)
        results.setdefault("needle", {}).update(res)
        for n in names:
            print(f"needle {n}: {res[n]['passed']}/{res[n]['total']}", flush=True)
    results.setdefault("configs", {})
    results["configs"] |= {n: asdict(c) | {"bits512": effective_bits(c, 512), "bits2048": effective_bits(c, 2048),
                                          "bits4096": effective_bits(c, 4096)} for n, c in cfgs.items()}
    if os.path.exists(args.out):  # merge with what another run wrote meanwhile (one level deep)
        with open(args.out) as f:
            disk = json.load(f)
        for k, v in results.items():
            if isinstance(v, dict) and isinstance(disk.get(k), dict):
                for kk, vv in v.items():
                    if isinstance(vv, dict) and isinstance(disk[k].get(kk), dict):
                        disk[k][kk] |= vv
                    else:
                        disk[k][kk] = vv
            else:
                disk[k] = v
        results = disk
    _common.write_json(args.out, results, quiet=True)
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
