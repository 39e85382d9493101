"""Helpers, fixtures and constants shared by `test_bad_input.py` and `test_bad_input_nonfinite.py`."""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from veloxquant_mlx.cache.turboquant_rvq_cache import TurboQuantRVQKVCache
from veloxquant_mlx.codecs import CODECS
from veloxquant_mlx.compat.config import KVCacheConfig
from veloxquant_mlx.apps.eval.specs import CONFIGURATIONS

D = 16


def _caches(n_layers=2, T=5):
    out = []
    for i in range(n_layers):
        c = TurboQuantRVQKVCache(KVCacheConfig(method="turboquant_rvq", head_dim=D, bit_width_inlier=2))
        rng = np.random.default_rng(i)
        k = mx.array(rng.standard_normal((1, 2, T, D)).astype(np.float32))
        c.update_and_fetch(k, k)
        out.append(c)
    return out


def _rewrite(path, drop=None, meta_edit=None, out=None):
    """Load a saved file's raw arrays/metadata, drop one array or edit the metadata, write it back."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    if drop is not None:
        del arrays[drop]
    if meta_edit is not None:
        meta_edit(meta)
    mx.save_safetensors(str(out or path), arrays, meta)


# --- non-finite keys / values (issue part 5): kept to their own token, or refused naming the argument ---------
# mlx_lm's KVCache keeps a non-finite token to itself. Layouts with per-token scales or norms do the same when they
# code it; a layout that codes keys (or values) per channel over blocks of tokens cannot hold one non-finite token
# without spreading it over its block or hiding it, so a cache refuses, naming the argument, the update that would
# code it (and stays unchanged). While such a token is exact (sink or tail) it is kept to itself.
NF_D, NF_T, NF_BAD = 64, 74, 10


def _nf_options(codec, **changes):
    base, layout = CONFIGURATIONS["tq-affine-k8v4"], CODECS[codec]
    bits = lambda cls, b: b if b in cls.BITS else cls.BITS[-1]  # noqa: E731
    return dataclasses.replace(base, codec=codec, k_bits=bits(layout.keys, 8), v_bits=bits(layout.values, 4), **changes)


def _nf_data(T, seed=0):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal((1, 2, T, NF_D)).astype(np.float32)) for _ in range(2)]


def _poison(x, value, token=NF_BAD):
    x = np.array(x)
    x[0, 0, token, 3] = value
    return mx.array(x)


def _blocked(codec, side):
    return getattr(CODECS[codec], side).BLOCKED


def _assert_only_token_bad(got, clean, bad_value, token=NF_BAD):
    """``got`` (1, H, n, d): row (0, 0, token) non-finite (NaN when NaN was fed), every other row finite and close to
    ``clean`` (the same cache fed no bad token), to the codec's own error."""
    g, c = np.array(got, dtype=np.float64), np.array(clean, dtype=np.float64)
    finite = np.isfinite(g).all(axis=-1)
    assert not finite[0, 0, token], "the non-finite token was hidden"
    if np.isnan(bad_value):
        assert np.isnan(g[0, 0, token]).any(), "NaN was turned into inf"
    others = np.ones(finite.shape, bool)
    others[0, 0, token] = False
    assert finite[others].all(), f"{int((~finite[others]).sum())} other rows became non-finite"
    err = np.abs(g[others] - c[others]).max() / np.abs(c[others]).max()
    assert err < 0.1, err  # measured <= 0.051 (4-bit Lloyd-Max values): the fitted centre skips the bad coordinate


def _nf_attention(cache, keys, values, side, token=NF_BAD):
    """Attention on the codes agrees with SDPA over the decoded history: non-finite where SDPA is, equal elsewhere; a
    bad key masked out leaves every output finite (a bad value does not: SDPA's ``0 * inf`` is NaN too)."""
    n = keys.shape[2]
    q = mx.array(np.random.default_rng(7).standard_normal((1, 4, 3, NF_D)).astype(np.float32))
    hide = mx.broadcast_to((mx.arange(n) != token)[None, None, None, :], (1, 1, 3, n))
    for mask in (hide, None):
        got = np.array(cache.attend_packed(q, 0.125, mask))
        want = np.array(mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask))
        assert (np.isfinite(got) == np.isfinite(want)).all()
        ok = np.isfinite(want)
        assert ok.all() or mask is None or side == "values"
        if ok.any():
            assert np.abs(got[ok] - want[ok]).max() <= 1e-4 * max(np.abs(want[ok]).max(), 1.0)

# --- zero rows / heads / channels: refused where the keys enter, naming them and what is allowed -----------------
def _zero_test_caches():
    from veloxquant_mlx.cache.packed_cache import TurboQuantBatchPackedCache, TurboQuantBatchRotatingPackedCache
    from veloxquant_mlx.cache.packed_cache import TurboQuantRotatingPackedCache

    block, lloyd = CONFIGURATIONS["tq-affine-k8v4"], CONFIGURATIONS["tq-mse-k4v4"]
    return {
        "packed-block": lambda: TurboQuantPackedCache(block),
        "packed-lloyd": lambda: TurboQuantPackedCache(lloyd),
        "rotating": lambda: TurboQuantRotatingPackedCache(lloyd, max_size=16, keep=4),
        "batch": lambda: TurboQuantBatchPackedCache(block, batch_size=2),
        "batch-of-none": lambda: TurboQuantBatchPackedCache(block, batch_size=0),
        "batch-rotating": lambda: TurboQuantBatchRotatingPackedCache(lloyd, batch_size=2, max_size=16, keep=4),
        "rvq": lambda: TurboQuantRVQKVCache(KVCacheConfig(method="turboquant_rvq", head_dim=NF_D, bit_width_inlier=2)),
    }


ZERO_SHAPES = {"no-rows": (0, 2, 100, NF_D), "no-heads": (2, 0, 100, NF_D), "no-rows-1": (0, 2, 1, NF_D),
               "no-heads-1": (2, 0, 1, NF_D), "no-channels": (2, 2, 3, 0)}
ZERO_MESSAGE = r"^keys must have shape \(B, H, T, d\) with B, H, d >= 1 \(at least one sequence, head and channel\)"
ZERO_CASES = [(name, shape, after) for name in sorted(_zero_test_caches()) for shape in ZERO_SHAPES
              for after in (False, True) if not (after and name == "batch-of-none")]  # (that one takes no update)


# --- quantizer codes: decode / estimate_inner_product refuse bad codes, naming them and what was expected --------
def _bad_codes(name):
    """(label, build the bad codes, error, words the message must hold) for the quantizer ``name`` (d=16, b=3)."""
    from veloxquant_mlx.quant.encoded_vector import EncodedVector

    def ev(drop=(), dim=16, **arrays):
        def build():
            good = QUANT[name].encode(QUANT_X).arrays()
            fields = {k: v for k, v in {**good, **arrays}.items() if k not in drop}
            return EncodedVector(quantizer_type=name, dim=dim, dtype_name="float32", **fields)
        return build

    good = lambda: QUANT[name].encode(QUANT_X).arrays()  # noqa: E731
    cases = [
        ("indices-cut-short", ev(indices=good()["indices"][..., :-1]), ValueError, ["indices", "words", "needs"]),
        ("indices-float32", ev(indices=good()["indices"].astype(mx.float32)), ValueError, ["indices", "integer"]),
        ("indices-missing-a-vector", ev(indices=good()["indices"][:-1]), ValueError, ["indices", "batch shape"]),
        ("other-dim", ev(dim=24), ValueError, ["dim 24", "d=16"]),
        ("plain-array", lambda: good()["indices"], TypeError, ["ev", "EncodedVector"]),
        ("none", lambda: None, TypeError, ["ev", "EncodedVector"]),
        ("norms-int", ev(norms=good()["norms"].astype(mx.int32)), ValueError, ["norms", "float"]),
    ]
    if name == "turboquant_prod":
        cases += [("no-signs", ev(drop=("signs",)), ValueError, ["signs", "missing"]),
                  ("no-residual-norms", ev(drop=("residual_norm",)), ValueError, ["residual_norm", "missing"]),
                  ("signs-cut-short", ev(signs=good()["signs"][..., :0]), ValueError, ["signs", "words"]),
                  ("residual-norms-int", ev(residual_norm=good()["residual_norm"].astype(mx.int32)), ValueError,
                   ["residual_norm", "float"])]
    if name == "turboquant_rvq":
        cases += [("no-indices2", ev(drop=("indices2",)), ValueError, ["indices2", "missing"]),
                  ("indices2-cut-short", ev(indices2=good()["indices2"][..., :-1]), ValueError, ["indices2", "words"])]
    return cases


def _quantizers():
    from veloxquant_mlx.quant.quantizers import QUANTIZERS

    return {n: cls(16, 3) for n, cls in QUANTIZERS.items()}


QUANT = _quantizers()
QUANT_X = mx.array(np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32))
QUANT_CASES = [(n, *c) for n in sorted(QUANT) for c in _bad_codes(n)]
