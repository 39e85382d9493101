"""What the codecs store for the rows (veloxquant_mlx.cache.row_codes): the compiled affine encoding handed to the
codecs where the caches code tokens (the same arrays as the reference, bit for bit), the tail (exact tokens in and
out, stored as its coder codes them), the tail's coder, and the layouts read once per configuration."""
from __future__ import annotations

import subprocess
import sys
import threading

import mlx.core as mx
import pytest

import veloxquant_mlx.attention.kernel
import veloxquant_mlx.cache.row_codes
import veloxquant_mlx.codecs.affine_encode
from veloxquant_mlx.cache.options import CacheOptions
from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache
from veloxquant_mlx.cache.row_codes import CodedTail, TailCoder, _layouts, column
from veloxquant_mlx.codecs import codec_layout
from veloxquant_mlx.codecs.affine_encode import reference_affine_encode

row_codes = veloxquant_mlx.cache.row_codes
affine_encode = veloxquant_mlx.codecs.affine_encode
kernel = veloxquant_mlx.attention.kernel


# -- the compiled encoding --------------------------------------------------------------------------------------
def test_importing_the_row_codes_hands_the_kernel_s_encoder_to_the_codecs():
    assert affine_encode._compiled_provider is veloxquant_mlx.attention.kernel.compiled_encoder
    assert kernel.compiled_encoder() is not None, kernel.status()[1]  # (CI builds the kernel: it really runs here)
    # in a fresh process: the codecs alone run the reference; importing the row codes is what hands it over
    script = ("import veloxquant_mlx.codecs.affine_encode as ae\n"
              "assert ae._compiled_provider is None, ae._compiled_provider\n"
              "import veloxquant_mlx.cache.row_codes\n"
              "import veloxquant_mlx.attention.kernel as kernel\n"
              "assert ae._compiled_provider is kernel.compiled_encoder\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def _fill(cache, seed=0):
    """A prompt, then decode steps across key blocks (block and per-token codes, keys with their bias offsets)."""
    k = mx.random.normal((1, 2, 200, 64), key=mx.random.key(seed)) * 1.5 + 0.4
    v = mx.random.normal((1, 2, 200, 64), key=mx.random.key(seed + 1))
    cache.update_and_fetch(k[:, :, :130], v[:, :, :130])
    for t in range(130, 200):
        cache.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
    return cache


@pytest.mark.parametrize("name", ["tq-affine-k8v4", "tq-affine-k4v4"])
def test_a_cache_s_keys_coded_through_the_compiled_encoder_equal_the_reference(name, monkeypatch):
    """Every call the cache makes to the compiled encoder returns what `reference_affine_encode` gives for the same
    input, bit for bit; and the cache stores exactly the codes of a cache coding through the reference alone."""
    calls = []

    def recording_provider():
        fn = kernel.compiled_encoder()
        assert fn is not None, kernel.status()[1]

        def encode(y, offset, bits, group, tokens_last, half):
            out = tuple(fn(y, offset, bits, group, tokens_last, half))
            calls.append(((y, offset, bits, group, tokens_last, half), out))
            return out

        return encode

    monkeypatch.setattr(affine_encode, "_compiled_provider", recording_provider)
    compiled = _fill(TurboQuantPackedCache(name))
    assert {c[0][4] for c in calls} == {True, False}  # block keys (tokens last) and per-token values both ran here
    assert any(c[0][1] is not None for c in calls)  # (keys with their per-channel bias offsets)
    for (y, offset, bits, group, tokens_last, half), got in calls:
        want = reference_affine_encode(y, bits, group, mx.float16 if half else mx.float32, tokens_last, offset)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b, equal_nan=True).item()

    monkeypatch.setattr(affine_encode, "_compiled_provider", None)  # the reference only
    n = len(calls)
    reference = _fill(TurboQuantPackedCache(name))
    assert len(calls) == n  # (the compiled encoder did not run)
    for store in ("k_codes", "v_codes"):
        a, b = getattr(compiled.rows, store).arrays, getattr(reference.rows, store).arrays
        assert a.keys() == b.keys() and a
        for f in a:
            assert a[f].dtype == b[f].dtype and mx.array_equal(a[f], b[f], equal_nan=True).item(), (store, f)


# -- the tail -----------------------------------------------------------------------------------------------------
def test_column_is_one_int_per_row():
    c = column([3, 0, 7])
    assert c.shape == (3, 1, 1, 1) and c.dtype == mx.int32 and c.reshape(-1).tolist() == [3, 0, 7]


def test_an_exact_tail_holds_the_tokens_themselves():
    tail = CodedTail(step=4)
    k = mx.random.normal((1, 2, 5, 8), key=mx.random.key(0)).astype(mx.float16)
    v = mx.random.normal((1, 2, 5, 8), key=mx.random.key(1))
    tail.append({"k": k, "v": v})
    assert (tail.length, tail.capacity, tail.step) == (5, 8, 4)  # grown in steps of 4 slots
    assert (tail.dtype("k"), tail.dtype("v")) == (mx.float16, mx.float32)
    assert tail.fields((8, 8)) == {"k": ((8,), mx.float16), "v": ((8,), mx.float32)}
    assert mx.array_equal(tail.view()["k"], k).item() and mx.array_equal(tail.view(1, 3)["v"], v[:, :, 1:3]).item()
    assert tail.buffers["k"].shape == (1, 2, 8, 8)  # (the arrays themselves, spare slots included)
    twin = tail.copy()
    twin.append({"k": k[:, :, :1], "v": v[:, :, :1]})
    assert (tail.length, twin.length) == (5, 6)
    assert tail.trim(2) == 2 and tail.length == 3 and mx.array_equal(tail.view()["v"], v[:, :, :3]).item()


def _kblock_pt():
    options = CacheOptions(codec="kblock_vsym8_pt", k_bits=4, group_size=128, center_keys=True,
                           center_values=False).layer_options()
    return options, codec_layout(options.codec).make(options, 64, 64)


def test_a_coded_tail_stores_its_coder_s_codes_and_reads_them_decoded():
    options, base = _kblock_pt()
    coder = TailCoder.for_codecs(options, base)
    assert coder is not None and coder.centred
    tail = CodedTail(16, coder)
    k = mx.random.normal((1, 2, 10, 64), key=mx.random.key(2))
    v = mx.random.normal((1, 2, 10, 64), key=mx.random.key(3))
    tail.append({"k": k, "v": v})
    assert set(tail.live_arrays()) == set(coder.fields((64, 64))) == {"k_w_q", "k_scales", "v_w_q", "v_scales"}
    want = coder.decode(coder.encode({"k": k, "v": v}), {"k": mx.float32, "v": mx.float32})
    got = tail.view()
    assert all(mx.array_equal(got[n], want[n]).item() for n in "kv")
    assert tail.nbytes < (k.nbytes + v.nbytes) / 4  # codes, not floats


def test_only_a_layout_with_a_tail_codec_and_no_exact_window_codes_its_tail():
    options, base = _kblock_pt()
    import dataclasses

    assert TailCoder.for_codecs(dataclasses.replace(options, recent=2), base) is None  # an exact window
    centred_values = dataclasses.replace(options, center_values=True)
    assert TailCoder.for_codecs(centred_values, codec_layout(options.codec).make(centred_values, 64, 64)) is None
    affine = CacheOptions(codec="affine", k_bits=4).layer_options()
    assert TailCoder.for_codecs(affine, codec_layout("affine").make(affine, 64, 64)) is None


# -- the layouts --------------------------------------------------------------------------------------------------
def test_layouts_are_read_once_per_configuration_and_thread():
    options = CacheOptions(codec="affine", k_bits=4, v_bits=2).layer_options()
    first = _layouts(options, (64, 64), 2)
    assert _layouts(options, (64, 64), 2) is first
    base, layouts, blank = first
    assert set(layouts[0]) == {"w_q", "scales", "biases"} and layouts[0]["w_q"][3] == mx.uint32
    assert all(a.shape[0] == 2 for fitted in blank for a in fitted.values())  # per head: rows can be batched
    other = []
    worker = threading.Thread(target=lambda: other.append(_layouts(options, (64, 64), 2)))
    worker.start()
    worker.join()
    assert other[0] is not first  # (MLX arrays belong to the stream of the thread that made them)
    assert row_codes._LAYOUTS[(options, (64, 64), 2, threading.get_ident())] is first
