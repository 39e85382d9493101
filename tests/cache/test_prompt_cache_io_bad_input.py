"""Bad input to prompt-cache files (`veloxquant_mlx.cache.prompt_cache_io`): clear errors naming the file / argument
(issue 15). (The CLI's bad input: tests/apps/cli/; bad keys, values and codes given to the caches and quantizers:
test_bad_input_nonfinite.py.)"""
from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache.prompt_cache_io import META_STATE_KEY, VERSION_KEY, load_prompt_cache, save_prompt_cache
from _bad_input_helpers import D, _caches, _rewrite


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
