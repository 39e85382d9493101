"""The numpy GGUF reader (`veloxquant_mlx.apps.models.gguf_numpy`): tensors and metadata as the ``gguf`` package's own
reader and dequantizer give them, a file's architecture read from its header only, damaged files named."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from veloxquant_mlx.apps.models.gguf_numpy import gguf_architecture, read_gguf_numpy


def test_gguf_reader_matches_gguf_package(tmp_path):
    """`read_gguf_numpy` against the ``gguf`` package's own reader and dequantizer, on a small file it writes."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    dense = rng.standard_normal((3, 64)).astype(np.float32)
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_uint32("test.count", 7)
    w.add_array("test.words", ["▁a", "b c", "日本"])
    w.add_array("test.scores", [0.5, -1.0, 2.0])
    w.add_tensor("dense.weight", dense)
    w.add_tensor("q8.weight", quantize(q8, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tensors, meta = read_gguf_numpy(path)
    assert meta["general.architecture"] == "gemma3" and meta["test.count"] == 7
    assert meta["test.words"] == ["▁a", "b c", "日本"]
    assert np.allclose(meta["test.scores"], [0.5, -1.0, 2.0])
    assert tensors["dense.weight"].shape == (3, 64) and np.array_equal(tensors["dense.weight"].dequantize(), dense)
    reader = gguf.GGUFReader(str(path))
    expected = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    got = tensors["q8.weight"].dequantize()
    assert got.shape == (4, 64) and np.array_equal(got, expected["q8.weight"].reshape(4, 64))
    assert np.abs(got - q8).max() < 0.05  # Q8_0 of standard normals
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="bad.gguf"):
        read_gguf_numpy(bad)
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_numpy(Path(__file__))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf is not a GGUF file"):
        read_gguf_numpy(tmp_path / "empty.gguf")


def test_architecture_is_read_from_the_header(tmp_path):
    import gguf

    for arch in ("gemma3", "llama", "qwen2"):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert gguf_architecture(path) == arch
    (tmp_path / "text.gguf").write_text("not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_architecture(tmp_path / "text.gguf")
