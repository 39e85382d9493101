"""Bad input to prompt-cache files and the CLI: clear errors naming the file / argument (issue 15); bad keys, values
and codes given to the caches and quantizers: refused naming the argument, or (non-finite values) kept to their token
(issue part 5)."""
from __future__ import annotations

import dataclasses
import json
import os

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from veloxquant_mlx.cache.prompt_cache_io import META_STATE_KEY, VERSION_KEY, load_prompt_cache, save_prompt_cache
from veloxquant_mlx.cache.turboquant_rvq_cache import TurboQuantRVQKVCache
from veloxquant_mlx.codecs import CODECS
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.eval.specs import CONFIGURATIONS

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


# --- saving -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cache.bin", "cache", "cache.safetensors.tmp"])
def test_save_refuses_a_name_mlx_would_rename(tmp_path, name):
    with pytest.raises(ValueError, match="file_name"):
        save_prompt_cache(str(tmp_path / name), _caches(1))
    assert os.listdir(tmp_path) == []  # nothing written under any name


def test_save_writes_exactly_the_path_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, _caches())  # os.PathLike accepted
    assert os.listdir(tmp_path) == ["c.safetensors"]
    assert len(load_prompt_cache(str(path))) == 2


def test_failed_save_keeps_the_good_file(tmp_path):
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, _caches())
    good = open(path, "rb").read()

    class Unserialisable:
        state = (object(),)

    with pytest.raises(ValueError):
        save_prompt_cache(path, [_caches(1)[0], Unserialisable()])
    assert open(path, "rb").read() == good
    assert os.listdir(tmp_path) == ["c.safetensors"]


@pytest.mark.parametrize("kwargs,err,word", [
    ({"cache": []}, ValueError, "cache"), ({"cache": "x"}, ValueError, "cache"),
    ({"metadata": {"a": 1}}, TypeError, "metadata"), ({"metadata": ["a"]}, TypeError, "metadata"),
    ({"metadata": {VERSION_KEY: "1"}}, ValueError, "reserved"), ({"file_name": 5}, TypeError, "file_name"),
    ({"file_name": "/nonexistent-dir/c.safetensors"}, FileNotFoundError, "nonexistent-dir"),
])
def test_save_bad_arguments_named(tmp_path, kwargs, err, word):
    args = {"file_name": str(tmp_path / "c.safetensors"), "cache": _caches(1), **kwargs}
    with pytest.raises(err, match=word):
        save_prompt_cache(**args)


def test_save_onto_a_directory(tmp_path):
    d = tmp_path / "d.safetensors"
    d.mkdir()
    with pytest.raises(IsADirectoryError, match="d.safetensors"):
        save_prompt_cache(str(d), _caches(1))


# --- metadata round trip --------------------------------------------------------------------------------
@pytest.mark.parametrize("meta", [None, {}, {"note": "x", "model": "tiny"}])
def test_metadata_comes_back_unchanged(tmp_path, meta):
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, _caches(), meta)
    loaded, got = load_prompt_cache(path, return_metadata=True)
    assert got == (meta or {})
    raw = mx.load(path, return_metadata=True)[1]
    assert any(VERSION_KEY in k for k in raw)  # the version is in the file, under the reserved key


# --- loading files that do not add up -------------------------------------------------------------------
def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_prompt_cache(str(tmp_path / "nope.safetensors"))
    with pytest.raises(IsADirectoryError, match=str(tmp_path.name)):
        load_prompt_cache(str(tmp_path))
    with pytest.raises(TypeError, match="file_name"):
        load_prompt_cache(None)


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.97])
def test_truncated_file_named(tmp_path, keep):
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), _caches())
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="c.safetensors"):
        load_prompt_cache(str(path))


def test_garbage_and_foreign_files_named(tmp_path):
    g = tmp_path / "g.safetensors"
    g.write_bytes(os.urandom(300))
    with pytest.raises(ValueError, match="g.safetensors"):
        load_prompt_cache(str(g))
    w = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(w), {"w": mx.zeros((2, 2))})
    with pytest.raises(ValueError, match="weights.safetensors.*prompt-cache metadata"):
        load_prompt_cache(str(w))


def test_unknown_class_name(tmp_path):
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), _caches())
    _rewrite(path, meta_edit=lambda m: m.__setitem__("1.1", "NoSuchCache"))
    with pytest.raises(ValueError, match="c.safetensors.*layer 1.*NoSuchCache"):
        load_prompt_cache(str(path))


@pytest.mark.parametrize("key", ["0.0", "0.1", "0.2", "0.3", "1.0", "1.3"])
def test_one_array_removed_is_refused_at_load(tmp_path, key):
    path = tmp_path / "c.safetensors"
    save_prompt_cache(str(path), _caches())
    _rewrite(path, drop=key)
    with pytest.raises(ValueError, match=r"c\.safetensors") as e:
        load_prompt_cache(str(path))
    layer = key.split(".")[0]
    assert f"layer {layer}" in str(e.value) or f"array {key!r}" in str(e.value)
    field = ("indices", "indices2", "norms", "values")[int(key.split(".")[1])]
    assert key in str(e.value) or field in str(e.value)


def test_from_state_value_error_gets_the_file_name(tmp_path):
    path = tmp_path / "c.safetensors"
    caches = _caches()
    save_prompt_cache(str(path), caches)
    # offset tampered in layer 0's meta_state (head_dim, bits, seed, offset): the class refuses, the loader names
    # the file
    arrays, meta = mx.load(str(path), return_metadata=True)
    meta_states = json.loads(meta["0." + META_STATE_KEY])  # mlx_lm flattens [metadata, classes, scalars]
    meta_states[0][3] = "50"
    meta["0." + META_STATE_KEY] = json.dumps(meta_states)
    mx.save_safetensors(str(path), arrays, meta)
    with pytest.raises(ValueError, match=r"c\.safetensors.*layer 0.*offset"):
        load_prompt_cache(str(path))


def test_round_trip_still_continues_identically(tmp_path):
    path = str(tmp_path / "c.safetensors")
    caches = _caches()
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    k = mx.array(np.random.default_rng(9).standard_normal((1, 2, 1, D)).astype(np.float32))
    for a, b in zip(caches, loaded):
        ka, va = a.update_and_fetch(k, k)
        kb, vb = b.update_and_fetch(k, k)
        assert mx.array_equal(ka, kb) and mx.array_equal(va, vb)


# --- the CLI ----------------------------------------------------------------------------------------
def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("data", [b"", b"GGUF", os.urandom(400)])
def test_cli_garbage_gguf_is_one_line(tmp_path, capsys, data):
    from veloxquant_mlx.cli import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    rc = main(["generate", "--model", str(bad), "--prompt", "hi", "--max-tokens", "1"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 1 and "bad.gguf" in line and "GGUF" in line


def test_truncated_embedded_gguf_is_a_value_error_naming_it(tmp_path):
    from veloxquant_mlx.models import load_model
    from veloxquant_mlx.models.loader import ModelPackageMissing, embedded_gguf_path

    try:
        src = embedded_gguf_path()
    except ModelPackageMissing:
        pytest.skip("embedded model package not installed")
    part = tmp_path / "part.gguf"
    with open(src, "rb") as f:
        part.write_bytes(f.read(3_000_000))  # header and metadata whole, tensor data cut
    with pytest.raises(ValueError, match="part.gguf"):
        load_model(str(part))


@pytest.mark.parametrize("argv_tail", [["demo"], ["eval", "ppl"], ["eval", "speed"]])
@pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
def test_cli_unwritable_out_refused_before_any_work(tmp_path, capsys, monkeypatch, argv_tail, where):
    import veloxquant_mlx.cli as cli

    def no_work(args):
        raise AssertionError("the model was loaded although --out cannot be written")

    for commands in (cli.run, cli.measure):  # (where demo and eval read `_load`)
        monkeypatch.setattr(commands, "_load", no_work)
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    out = str(blocker / "sub" / "r.json") if where == "under_a_file" else str(tmp_path)
    rc = cli.main(argv_tail + ["--out", out])
    line = _one_line(capsys.readouterr().err)
    assert rc != 0 and "--out" in line


def test_cli_unwritable_plot_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import veloxquant_mlx.cli as cli

    monkeypatch.setattr(cli.measure, "_load", lambda args: (_ for _ in ()).throw(AssertionError("loaded")))
    rc = cli.main(["eval", "ppl", "--plot", str(tmp_path)])
    assert rc != 0 and "--plot" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "-1", "0", "x"])
def test_cli_plan_ram_gb_must_be_finite_positive(capsys, value):
    from veloxquant_mlx.cli import main

    rc = main(["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", f"--ram-gb={value}"])
    line = _one_line(capsys.readouterr().err)
    assert rc == 2 and "--ram-gb" in line and "positive number" in line


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


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("side", ["keys", "values"])
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_one_non_finite_coordinate_stays_in_its_token_or_is_refused(codec, side, bad):
    opts = _nf_options(codec)
    k, v = _nf_data(NF_T)
    kb, vb = (_poison(k, bad), v) if side == "keys" else (k, _poison(v, bad))
    clean, cache = TurboQuantPackedCache(opts), TurboQuantPackedCache(opts)
    clean_hist = clean.update_and_fetch(k, v)
    hist = cache.update_and_fetch(kb, vb)
    i = 0 if side == "keys" else 1
    _assert_only_token_bad(hist[i], clean_hist[i], bad)
    assert bool(mx.array_equal(hist[1 - i], clean_hist[1 - i]))  # the other argument is untouched
    _nf_attention(cache, *hist, side)

    # The next tokens make the cache code token 10: a per-token layout keeps it to itself, a block layout refuses.
    k2, v2 = _nf_data(64, seed=1)
    clean_more = clean.update_and_fetch(k2, v2)
    if _blocked(codec, side):
        with pytest.raises(ValueError, match=rf"^{side}\b.*token {NF_BAD}\b.*{codec}") as e:
            cache.update_and_fetch(k2, v2)
        assert "non-finite" in str(e.value)
        assert cache.offset == NF_T and cache.n_coded == 0  # unchanged: the same history as before
        assert all(bool(mx.array_equal(a, b, equal_nan=True)) for a, b in zip(cache._fetch(mx.float32), hist))
    else:
        more = cache.update_and_fetch(k2, v2)
        assert cache.rows.sink_n[0] + cache.n_coded > NF_BAD  # token 10 is coded now
        _assert_only_token_bad(more[i], clean_more[i], bad)
        _nf_attention(cache, *more, side)


@pytest.mark.parametrize("codec", ["affine_block", "affine_block_kv"])
def test_block_layout_refuses_a_non_finite_key_in_the_update_that_codes_it(codec):
    """Coded at once (no trim headroom): the first update itself is refused and stores nothing."""
    cache = TurboQuantPackedCache(_nf_options(codec, trim_headroom=0))
    k, v = _nf_data(NF_T)
    with pytest.raises(ValueError, match=r"^keys\b.*token 10\b"):
        cache.update_and_fetch(_poison(k, float("inf")), v)
    assert cache.empty() and cache.n_coded == 0 and cache.dims is None
    cache.update_and_fetch(k, v)  # the same cache takes finite keys afterwards
    assert cache.n_coded == 64


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("name,role", sorted({(n, r) for n in CODECS for r in ("keys", "values")}))
def test_codec_never_hides_a_non_finite_token(name, role, bad):
    """Under the caches' refusal, each codec's own contract: a per-token layout keeps a non-finite token to itself;
    a block layout cannot, and decodes its block NaN (never a finite value in place of the bad one)."""
    layout = CODECS[name]
    cls = getattr(layout, role)
    codec = cls.from_options(_nf_options(name), role, NF_D)
    x = _poison(_nf_data(128)[0], bad)
    codec.fit(x)
    y = np.array(codec.decode(codec.encode(x), mx.float32))
    bad_rows = ~np.isfinite(y).all(axis=-1)
    want = np.zeros(bad_rows.shape, bool)
    if cls.BLOCKED:
        start = NF_BAD // codec.token_block * codec.token_block
        want[0, 0, start: start + codec.token_block] = True
    else:
        want[0, 0, NF_BAD] = True
    assert (bad_rows == want).all(), np.nonzero(bad_rows)
    if np.isnan(bad) or cls.BLOCKED:
        assert np.isnan(y[0, 0, NF_BAD]).any()

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


@pytest.mark.parametrize("name,shape,after", ZERO_CASES,
                         ids=[f"{n}-{s}-{'after-an-update' if a else 'fresh'}" for n, s, a in ZERO_CASES])
def test_empty_batch_or_heads_refused_naming_keys(name, shape, after):
    from veloxquant_mlx import use_packed_attention

    shape = ZERO_SHAPES[shape]
    cache = _zero_test_caches()[name]()
    with use_packed_attention():  # (batch caches attend only from their codes)
        if after:
            cache.update_and_fetch(*(mx.zeros((2, 2, 70, NF_D)) for _ in range(2)))
        offset = np.array(cache.offset).tolist()
        x = mx.zeros(shape)
        with pytest.raises(ValueError, match=ZERO_MESSAGE) as e:
            cache.update_and_fetch(x, x)
    assert str(tuple(shape)) in str(e.value)
    assert np.array(cache.offset).tolist() == offset


def test_batch_filtered_to_no_sequences_refuses_a_decode_step():
    from veloxquant_mlx import use_packed_attention

    caches = [TurboQuantPackedCache(CONFIGURATIONS["tq-affine-k8v4"]) for _ in range(2)]
    for c in caches:
        c.update_and_fetch(*_nf_data(5))
    batch = TurboQuantPackedCache.merge(caches)
    with use_packed_attention():
        batch.update_and_fetch(*(mx.zeros((2, 2, 1, NF_D)) for _ in range(2)))
        batch.filter([])
        x = mx.zeros((0, 2, 1, NF_D))
        with pytest.raises(ValueError, match=ZERO_MESSAGE):
            batch.update_and_fetch(x, x)


# --- quantizer codes: decode / estimate_inner_product refuse bad codes, naming them and what was expected --------
def _bad_codes(name):
    """(label, build the bad codes, error, words the message must hold) for the quantizer ``name`` (d=16, b=3)."""
    from veloxquant_mlx.core.context import EncodedVector

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
    from veloxquant_mlx.quantizers import QUANTIZERS

    return {n: cls(16, 3) for n, cls in QUANTIZERS.items()}


QUANT = _quantizers()
QUANT_X = mx.array(np.random.default_rng(3).standard_normal((3, 16)).astype(np.float32))
QUANT_CASES = [(n, *c) for n in sorted(QUANT) for c in _bad_codes(n)]


@pytest.mark.parametrize("name,label,build,err,words", QUANT_CASES, ids=[f"{c[0]}-{c[1]}" for c in QUANT_CASES])
def test_quantizer_decode_refuses_bad_codes_by_name(name, label, build, err, words):
    q = mx.array(np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32))
    quant = QUANT[name]
    try:
        bad = build()
    except (ValueError, TypeError) as e:  # refused where the codes are built: the same contract
        assert isinstance(e, err) and all(w in str(e) for w in words), e
        return
    for call in (lambda: quant.decode(bad), lambda: quant.decode_rotated(bad),
                 lambda: quant.estimate_inner_product(q, bad), lambda: quant.estimate_inner_product(q[0], bad)):
        with pytest.raises(err) as e:
            mx.eval(call())
        assert all(w in str(e.value) for w in words), e.value
