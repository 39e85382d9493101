"""Read a GGUF file whose tensors MLX's reader refuses (K-quants: Q4_K, Q5_K, Q6_K...) and dequantize it with numpy.

``mx.load(gguf)`` only converts F32/F16/Q4_0/Q4_1/Q8_0 ("gguf_tensor_to_f16 failed" otherwise); the ``gguf``
package's ``quants.dequantize`` handles every llama.cpp block type. Its ``GGUFReader`` however parses each of a
262k-token vocabulary's strings into several numpy views (16 s for Gemma 3's file), so the header is parsed here
(the format is small: magic, version, key/value metadata, tensor infos, aligned data; under 1 s for that file)
and the tensor bytes are numpy views of one read-only memory map.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format (8: string, 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor's raw bytes: ``data`` is uint8 of shape ``(*rows, bytes per row)`` (GGUF lists dims innermost
    first; here they are reversed to numpy's row-major order), ``qtype`` the ggml type number."""

    name: str
    shape: Tuple[int, ...]  # logical shape, row-major (numpy order)
    qtype: int
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 array of ``shape`` (``gguf.quants.dequantize`` handles every llama.cpp block type)."""
        out = dequantize(self.data, GGMLQuantizationType(self.qtype))
        return np.asarray(out, dtype=np.float32).reshape(self.shape)


class _Cursor:
    """Little-endian reads from a buffer, advancing an offset."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _NUMPY:  # numbers: one numpy copy (a vocabulary's scores and token types)
                dt = np.dtype(_NUMPY[item]).newbyteorder("<")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos += arr.nbytes
                return arr
            return [self.value(item) for _ in range(count)]  # arrays of arrays
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind])


def read_gguf_numpy(path: str | Path) -> Tuple[Dict[str, GGUFTensor], Dict[str, Any]]:
    """(tensors by GGUF name, metadata) of a GGUF v2/v3 file; tensors are lazy views of a memory map (the file is
    read when a tensor is dequantized). Metadata: Python scalars and strings, string lists, numpy number arrays."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if path.stat().st_size < 24:  # magic, version and the two counts
        raise ValueError(f"{path} is not a GGUF file (only {path.stat().st_size} bytes)")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(buf)
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        cur.pos = 4
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        meta: Dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-cur.pos // align) * align
        raw = np.frombuffer(buf, dtype=np.uint8)
        tensors = {}
        for name, dims, qtype, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise ValueError(f"{path}: tensor {name!r} has a ggml type ({qtype}) the gguf package does not know")
            shape = tuple(int(d) for d in reversed(dims))
            if shape[-1] % block:
                raise ValueError(f"{path}: tensor {name!r} rows of {shape[-1]} are not whole {block}-blocks")
            row_bytes = shape[-1] // block * type_size
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            at = start + offset
            if at + rows * row_bytes > len(raw):
                raise ValueError(f"{path} is truncated: tensor {name!r} runs past the end of the file")
            data = raw[at:at + rows * row_bytes].reshape(*shape[:-1], row_bytes)
            tensors[name] = GGUFTensor(name, shape, qtype, data)
    except (struct.error, UnicodeDecodeError, KeyError) as e:
        raise ValueError(f"{path} is not a readable GGUF file (truncated, corrupt or another format): {e}") from None
    return tensors, meta


def gguf_architecture(path: str | Path) -> str | None:
    """``general.architecture`` of a GGUF file, reading only its metadata (cheap: no tensor is touched)."""
    _, meta = read_gguf_numpy(path)
    arch = meta.get("general.architecture")
    return arch if isinstance(arch, str) else None
