"""`Calibration`: per-layer channel weights and the statistics they came from, bound to one model; its file.

A file is one ``.safetensors`` (MLX's writer) holding float32 arrays ``(layers, kv_heads, head_dim)``:
``key_weights``, ``value_weights`` (what caches use) and the statistics they were computed from
(``key_variance``, ``query_power``, ``value_power``, ``output_power``), plus one metadata entry `META_KEY`: JSON
with the format version, the model fingerprint, the calibration text's description and token count, the weights'
exponent. Loading checks everything against everything else (`Calibration.load`): a file that does not add up is
refused naming the file and the array; a calibration used with another model is refused naming both.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from veloxquant_mlx._version import __version__
from veloxquant_mlx.quant.channel_weights import is_power_of_two, unrotated_score_error
from veloxquant_mlx.integration.model_shape import model_kv_shape

FORMAT = 1
# A layer whose block keys are better coded without a rotation: `unrotated_score_error` below this for every KV head.
# Measured (issue 55, BENCHMARKS.md): Gemma 3 270M's full-attention layers 0.07-0.24 (its window layers >= 0.61), where
# keys without the rotation cut tq-4b's KL on the Bible 7x (0.042 -> 0.006); SmolLM2-135M's layers >= 0.71, where they
# raise it (0.022 -> 0.028 on the Debian text): a rotation also evens out heavy-tailed channels, which the prediction
# leaves out.
UNROTATED_BELOW = 0.5
META_KEY = "veloxquant_calibration"
SUFFIX = ".safetensors"
WEIGHTS = ("key_weights", "value_weights")
STATISTICS = ("key_variance", "query_power", "value_power", "output_power")


def key_rotations(query_power: mx.array, key_variance: mx.array) -> Tuple[Optional[str], ...]:
    """Per layer of ``(layers, kv_heads, head_dim)`` statistics: ``"none"`` where every KV head's
    `unrotated_score_error` is below `UNROTATED_BELOW` (its block keys coded in the model's own channels), else None."""
    below = mx.stack([mx.all(unrotated_score_error(query_power[i], key_variance[i]) < UNROTATED_BELOW)
                      for i in range(query_power.shape[0])])
    return tuple("none" if b else None for b in below.tolist())


def _array_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:  # (NumPy has no bfloat16: hash its bits)
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def model_fingerprint(model) -> Dict[str, Any]:
    """What a calibration is bound to: the model type, its KV shape, and a digest of the first and last layers'
    parameters (a different checkpoint of the same architecture differs there)."""
    layers, kv_heads, head_dim = model_kv_shape(model)
    h = hashlib.sha256()
    for layer in (model.layers[0], model.layers[-1]):
        if not callable(getattr(layer, "parameters", None)):
            raise ValueError(f"cannot fingerprint {type(model).__name__}: its layers hold no parameters (a stand-in "
                             "model?), so a calibration cannot be checked against it")
        for name, a in sorted(tree_flatten(layer.parameters()), key=lambda t: t[0]):
            h.update(name.encode())
            h.update(str((a.shape, a.dtype)).encode())
            h.update(_array_bytes(a))
    return {"model_type": str(getattr(model, "model_type", type(model).__name__)), "layers": int(layers),
            "kv_heads": int(kv_heads), "head_dim": int(head_dim), "digest": h.hexdigest()[:32]}


def _describe(fp: Dict[str, Any]) -> str:
    return (f"{fp.get('model_type')} ({fp.get('layers')} layers, {fp.get('kv_heads')} KV heads, head_dim "
            f"{fp.get('head_dim')}, digest {str(fp.get('digest'))[:12]})")


@dataclass(frozen=True, eq=False)
class Calibration:
    """Channel weights per layer, measured on one model (`veloxquant_mlx.calibrate` makes one).

    arrays: name -> float32 ``(layers, kv_heads, head_dim)``: `WEIGHTS` and `STATISTICS`.
    model: the model fingerprint (`model_fingerprint`). text: what it was measured on (``source``,
    ``description``, ``tokens``). power: the weights' exponent. Use it with ``calibration=`` in
    `make_prompt_cache`, `enable`, and the CLI's ``--calibration FILE``.
    """

    arrays: Dict[str, mx.array]
    model: Dict[str, Any]
    text: Dict[str, Any]
    power: float = 0.25
    path: Optional[str] = field(default=None, compare=False)

    def __post_init__(self):
        _check_arrays(self.arrays, self.model, self.path or "<calibration>")

    @property
    def layers(self) -> int:
        return int(self.model["layers"])

    @property
    def id(self) -> str:
        """A short digest of the weights and the model they belong to (what saved caches record)."""
        h = hashlib.sha256(self.model["digest"].encode())
        for name in WEIGHTS:
            h.update(_array_bytes(self.arrays[name]))
        return h.hexdigest()[:16]

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (per model, not per token; caches do not count them in their own bytes)."""
        return sum(a.nbytes for a in self.arrays.values())

    def layer_weights(self, layer: int) -> Tuple[mx.array, mx.array]:
        """Layer ``layer``'s ``(key weights, value weights)``, each ``(kv_heads, head_dim)`` float32."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer must be in [0, {self.layers}), got {layer}")
        return self.arrays["key_weights"][layer], self.arrays["value_weights"][layer]

    def layer_log2(self, layer: int):
        """Layer ``layer``'s weights as ``CacheOptions.channel_log2``: (keys, values), each heads x head_dim ints."""
        return tuple(tuple(tuple(int(e) for e in row) for row in np.log2(np.array(w)).round().astype(int).tolist())
                     for w in self.layer_weights(layer))

    def key_rotation(self, layer: int) -> Optional[str]:
        """``"none"`` when layer ``layer``'s keys, coded per channel over blocks, measure better in the model's own
        channels (`unrotated_score_error` < `UNROTATED_BELOW` for every KV head), else None (the options' own)."""
        if not 0 <= layer < self.layers:
            raise ValueError(f"layer must be in [0, {self.layers}), got {layer}")
        return self._key_rotations[layer]

    @cached_property
    def _key_rotations(self) -> Tuple[Optional[str], ...]:
        # every layer in one evaluation, once: the builder asks per layer for every request a server builds
        return key_rotations(self.arrays["query_power"], self.arrays["key_variance"])

    def check_model(self, model) -> None:
        """ValueError naming both models unless ``model`` is the one this calibration was measured on."""
        fp = model_fingerprint(model)
        if fp != self.model:
            where = f" ({self.path})" if self.path else ""
            raise ValueError(f"calibration{where} was measured on {_describe(self.model)}, but this model is "
                             f"{_describe(fp)}: calibrate this model (veloxquant_mlx.calibrate / veloxquant "
                             f"calibrate) or pass its own calibration")

    def metadata(self) -> Dict[str, Any]:
        return {"format": FORMAT, "library_version": __version__, "model": self.model, "text": self.text,
                "power": self.power, "id": self.id}

    def save(self, path) -> str:
        """Write to ``path`` (must end in ``.safetensors``) through a temporary name renamed into place."""
        path = _check_path(path)
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"calibration file {path!r}: directory {directory!r} does not exist")
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp{SUFFIX}")
        try:
            mx.save_safetensors(tmp, dict(self.arrays), metadata={META_KEY: json.dumps(self.metadata())})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return path

    @classmethod
    def load(cls, path, model=None) -> "Calibration":
        """Read and check a calibration file; with ``model``, also check it belongs to that model."""
        path = _check_path(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"calibration file {path!r} does not exist")
        try:
            arrays, meta = mx.load(path, return_metadata=True)
        except Exception as e:  # MLX's own message for a truncated / foreign file
            raise ValueError(f"calibration file {path!r} is not a readable safetensors file: {e}") from None
        raw = meta.get(META_KEY)
        if raw is None:
            raise ValueError(f"calibration file {path!r} has no {META_KEY!r} metadata: not a veloxquant calibration")
        try:
            info = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"calibration file {path!r}: metadata {META_KEY!r} is not JSON ({e})") from None
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise ValueError(f"calibration file {path!r}: format {info.get('format') if isinstance(info, dict) else info!r}"
                             f" is not one this version reads ({FORMAT})")
        for key, kind in (("model", dict), ("text", dict), ("power", (int, float))):
            if not isinstance(info.get(key), kind):
                raise ValueError(f"calibration file {path!r}: metadata field {key!r} is missing or malformed")
        cal = cls(arrays=dict(arrays), model=info["model"], text=info["text"], power=float(info["power"]), path=path)
        if info.get("id") != cal.id:
            raise ValueError(f"calibration file {path!r}: its arrays do not match its recorded id {info.get('id')!r} "
                             f"(computed {cal.id!r}): the file was changed after it was written")
        if model is not None:
            cal.check_model(model)
        return cal

    def __repr__(self):
        return (f"Calibration(id={self.id}, model={_describe(self.model)}, text={self.text.get('description')!r}, "
                f"{self.text.get('tokens')} tokens, {self.nbytes} bytes)")


def _check_path(path) -> str:
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"calibration path must be a non-empty str or os.PathLike, got {path!r}")
    path = os.fspath(path)
    if not path.endswith(SUFFIX):
        raise ValueError(f"calibration path must end in {SUFFIX!r}, got {path!r}")
    return path


def _check_arrays(arrays: Dict[str, mx.array], model: Dict[str, Any], where: str) -> None:
    """ValueError naming ``where`` and the array unless every array is float32 ``(layers, kv_heads, head_dim)``,
    finite, non-negative, and the weights are powers of two."""
    if not isinstance(model, dict) or not all(isinstance(model.get(k), int) and model.get(k) > 0
                                              for k in ("layers", "kv_heads", "head_dim")):
        raise ValueError(f"calibration {where}: model fingerprint {model!r} lacks layers / kv_heads / head_dim")
    shape = (model["layers"], model["kv_heads"], model["head_dim"])
    for name in WEIGHTS + STATISTICS:
        a = arrays.get(name)
        if a is None:
            raise ValueError(f"calibration {where}: array {name!r} is missing")
        if a.dtype != mx.float32 or tuple(a.shape) != shape:
            raise ValueError(f"calibration {where}: array {name!r} must be float32 {shape}, got {a.dtype} "
                             f"{tuple(a.shape)}")
        if not bool(mx.all(mx.isfinite(a) & (a >= 0)).item()):
            raise ValueError(f"calibration {where}: array {name!r} holds negative or non-finite entries")
    for name in WEIGHTS:
        if not is_power_of_two(arrays[name]):
            raise ValueError(f"calibration {where}: array {name!r} must hold powers of two within the clipping "
                             f"range (weights that keep exact tokens exact)")
    extra = sorted(set(arrays) - set(WEIGHTS + STATISTICS))
    if extra:
        raise ValueError(f"calibration {where}: unexpected arrays {extra}")
