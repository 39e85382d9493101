"""The candidates of ``benchmarks/probes/attention.py``'s table mode (its default: packed codes vs uncompressed SDPA
vs mlx-lm's quantized SDPA, one layer's decode step; the module docstring there lists them): `build_candidates`, and
`_gather_codec` for ``ours_lloyd4_gather``.

A helper, not a probe: ``attention.py`` imports it (``from benchmarks.probes._attention_candidates import ...``); the
names stay importable from ``benchmarks.probes.attention``. MLX, mlx_lm and veloxquant_mlx are imported inside the
functions (after `veloxquant_mlx.apps.blas.ensure_openblas`, as the probe runs them).
"""
from __future__ import annotations


def build_candidates(Hq: int, Hkv: int, d: int, n: int, seed: int, skip_f16_above: int, lloyd_max_n: int,
                     compiled: bool = False, only=None):
    """name -> (zero-arg function returning the output, bytes per token per KV head for K+V); ``only``: keep
    the candidates whose name contains one of these strings (and ``sdpa_f32``, the reference)."""
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from veloxquant_mlx.attention.packed_sdpa import coded_attention
    from veloxquant_mlx.codecs import AffineBlockKeyCodec, AffineRotatedCodec, LloydMaxCodec

    GatherLloydMax = _gather_codec()

    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    # Keys with a per-channel offset, like real keys (what centering is for); values plain.
    K = mx.random.normal((1, Hkv, n, d), key=k1) + 0.5 * mx.random.normal((1, Hkv, 1, d), key=k3)
    V = mx.random.normal((1, Hkv, n, d), key=k2)
    q = mx.random.normal((1, Hq, 1, d), key=k4)
    scale = d ** -0.5
    mx.eval(K, V, q)
    cands = {}

    cands["sdpa_f32"] = (lambda: mx.fast.scaled_dot_product_attention(q, K, V, scale=scale), 2 * 4 * d)
    if n <= skip_f16_above:
        K16, V16, q16 = K.astype(mx.float16), V.astype(mx.float16), q.astype(mx.float16)
        mx.eval(K16, V16, q16)
        cands["sdpa_f16"] = (
            lambda: mx.fast.scaled_dot_product_attention(q16, K16, V16, scale=scale), 2 * 2 * d)

    for bits in (4, 8):
        qk, qv = mx.quantize(K, 64, bits), mx.quantize(V, 64, bits)
        mx.eval(*qk, *qv)
        nb = 2 * sum(a.nbytes for a in qk) // (Hkv * n)

        def f(qk=qk, qv=qv, bits=bits):
            # mlx-lm scales its queries in place (queries *= scale): hand it its own array object.
            return quantized_scaled_dot_product_attention(
                mx.array(q), qk, qv, scale=scale, mask=None, group_size=64, bits=bits)
        cands[f"mlxlm_q{bits}"] = (f, nb)

    def ours(name, kc, vc, window=False, with_compiled=False):
        kc.fit(K)
        vc.fit(V)
        ka, va = kc.encode(K), vc.encode(V)
        mx.eval(*ka.values(), *va.values())
        nb = (sum(a.nbytes for a in ka.values()) + sum(a.nbytes for a in va.values())) // (Hkv * n)
        sink = recent = None
        if window:
            sink = (K[:, :, :4], V[:, :, :4])
            recent = (K[:, :, -128:], V[:, :, -128:])
            mx.eval(*sink, *recent)

        def f():
            return coded_attention(q, kc, ka, vc, va, scale, None, sink=sink, recent=recent)
        cands[name] = (f, nb)
        if with_compiled:
            # mx.compile over the whole decode step (codes as inputs; recompiles when n changes).
            kn, vn = sorted(ka), sorted(va)

            def step(q_, *arrs):
                return coded_attention(q_, kc, dict(zip(kn, arrs[: len(kn)])), vc, dict(zip(vn, arrs[len(kn):])), scale)
            cstep = mx.compile(step)
            args = [ka[k] for k in kn] + [va[k] for k in vn]
            cands[name + "_c"] = (lambda: cstep(q, *args), nb)

    for bits in (4, 3, 2):
        ours(f"ours_aff{bits}", AffineRotatedCodec(d, bits, seed=1), AffineRotatedCodec(d, bits, seed=2),
             with_compiled=compiled and bits == 4)
    ours("ours_aff4_f32s", AffineRotatedCodec(d, 4, seed=1, scale_dtype="float32"),
         AffineRotatedCodec(d, 4, seed=2, scale_dtype="float32"))
    for bits in (4, 2):
        ours(f"ours_blk{bits}", AffineBlockKeyCodec(d, bits, seed=1), AffineRotatedCodec(d, bits, seed=2),
             with_compiled=compiled and bits == 4)
    ours("ours_blk4v2", AffineBlockKeyCodec(d, 4, seed=1), AffineRotatedCodec(d, 2, seed=2))
    ours("ours_blk8v4", AffineBlockKeyCodec(d, 8, seed=1), AffineRotatedCodec(d, 4, seed=2))
    ours("ours_blk8", AffineBlockKeyCodec(d, 8, seed=1), AffineRotatedCodec(d, 8, seed=2))
    ours("ours_blk4_win", AffineBlockKeyCodec(d, 4, seed=1), AffineRotatedCodec(d, 4, seed=2), window=True)
    for bits in (4, 3, 2):
        ours(f"ours_lloyd{bits}", LloydMaxCodec("turboquant_mse", d, bits, seed=1),
             LloydMaxCodec("turboquant_mse", d, bits, seed=1001))
    ours("ours_prod4", LloydMaxCodec("turboquant_prod", d, 4, seed=1), LloydMaxCodec("turboquant_mse", d, 4, seed=1001))
    ours("ours_rvq2", LloydMaxCodec("turboquant_rvq", d, 2, seed=1), LloydMaxCodec("turboquant_rvq", d, 2, seed=1001))
    if n <= lloyd_max_n:  # the gather path: ~10x float32 SDPA, kept to a reference size by default
        ours("ours_lloyd4_gather", GatherLloydMax("turboquant_mse", d, 4, seed=1),
             GatherLloydMax("turboquant_mse", d, 4, seed=1001))
    return {k: v for k, v in cands.items() if k == "sdpa_f32" or not only or any(o in k for o in only)}


def _gather_codec():
    from veloxquant_mlx.codecs import LloydMaxCodec

    class GatherLloydMax(LloydMaxCodec):
        """`LloydMaxCodec` without its fused level kernels: every group read through MLX's gather."""

        def _fast(self, g, quant, codes):
            return None

        def affine_codes(self, codes):  # not the compiled attention either
            return None

    return GatherLloydMax
