"""Prompt-cache files holding veloxquant caches, in mlx_lm's own ``.safetensors`` format.

The file layout is exactly mlx_lm's (``save_prompt_cache`` writes it): each cache's ``state`` flattened
into arrays, its class name in the metadata. Our packed caches (single and batch) put their options in ``state`` (a
JSON string), so a file is self-describing; the seed page's `TurboQuantRVQKVCache` keeps its configuration in
``meta_state``, which mlx_lm's files do not hold: `save_prompt_cache` here writes it in the metadata
(`META_STATE_KEY`) and `load_prompt_cache` passes it back.

mlx_lm's ``load_prompt_cache`` looks class names up in its own module's globals, where ours are not.
`mlx_lm_cache_classes()` (:mod:`veloxquant_mlx.cache.registry`, importable from here and the integration too) is an explicit, reversible
context in which they are: inside the ``with`` block, ``mlx_lm.models.cache.load_prompt_cache`` (and ``CacheList``
restores) can rebuild our caches; on exit the module is as it was. Nothing is patched at import time.

`save_prompt_cache` here writes through mlx_lm's writer, but to a temporary name in the target directory
that is then renamed over ``file_name`` (a crash never leaves a half-written file in place of a good one);
it refuses names that do not end in ``.safetensors`` (MLX would silently append the suffix). The user's
metadata comes back from `load_prompt_cache` unchanged: the writer's version goes in the reserved key
`VERSION_KEY`, which the loader strips. `load_prompt_cache` reads the same layout as mlx_lm's loader
(one pass over the file) so that every failure -- missing file, directory, truncated or foreign file,
unknown class, an array removed, a state its class's ``from_state`` refuses -- is a clear error naming
the file (and the layer / array).
"""
from __future__ import annotations

import json
import os
import uuid
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx._version import __version__
from veloxquant_mlx.cache import registry
from veloxquant_mlx.cache.registry import mlx_lm_cache_classes
from veloxquant_mlx.compat.turboquant_rvq_cache import TurboQuantRVQKVCache

VERSION_KEY = "__veloxquant_mlx_version__"
# Per layer, the meta_state of caches whose from_state needs one (the seed's TurboQuantRVQKVCache: its state is
# only its four arrays) as a JSON list, None for the others: mlx_lm >= 0.32 writes state alone.
META_STATE_KEY = "__veloxquant_meta_state__"
SUFFIX = ".safetensors"


def _check_path(file_name, what: str) -> str:
    if not isinstance(file_name, (str, os.PathLike)):
        raise TypeError(f"{what}: file_name must be a str or os.PathLike, got {type(file_name).__name__}")
    path = os.fspath(file_name)
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what}: file_name must be a non-empty path, got {file_name!r}")
    return path


def save_prompt_cache(file_name: str, cache: List[Any], metadata: Optional[Dict[str, str]] = None) -> None:
    """Save ``cache`` (any mix of our and mlx_lm's caches) to exactly ``file_name`` in mlx_lm's format.

    ``file_name`` must end in ``.safetensors``. The file is written under a temporary name in the same
    directory and renamed over ``file_name`` only once complete.
    """
    path = _check_path(file_name, "save_prompt_cache")
    if not path.endswith(SUFFIX):
        raise ValueError(f"save_prompt_cache: file_name must end in {SUFFIX!r} (the format mlx_lm reads), "
                         f"got {path!r}")
    if not isinstance(cache, (list, tuple)) or not cache:
        raise ValueError("save_prompt_cache: cache must be a non-empty list of per-layer caches")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise TypeError("save_prompt_cache: metadata must be a dict mapping str to str")
    for key in (VERSION_KEY, META_STATE_KEY):
        if metadata and key in metadata:
            raise ValueError(f"save_prompt_cache: metadata key {key!r} is reserved")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"save_prompt_cache: directory of {path!r} does not exist")
    if os.path.isdir(path):
        raise IsADirectoryError(f"save_prompt_cache: {path!r} is a directory")
    meta = dict(metadata or {})
    meta[VERSION_KEY] = __version__
    meta[META_STATE_KEY] = json.dumps([_meta_state(c) for c in cache])
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp{SUFFIX}")
    try:
        mlx_cache.save_prompt_cache(tmp, list(cache), meta)
        with open(tmp, "rb") as f:  # on disk before the rename makes it visible
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(f"save_prompt_cache: could not write {path!r}: {e}") from e
    except RuntimeError as e:  # MLX reports I/O failures as RuntimeError
        raise OSError(f"save_prompt_cache: could not write {path!r}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _meta_state(cache):
    return list(cache.meta_state) if isinstance(cache, TurboQuantRVQKVCache) else None


def _read_meta_states(metadata: dict, n_layers: int, path: str) -> list:
    """Per layer, the meta_state `save_prompt_cache` wrote (None: the layer has none, or mlx_lm wrote the file)."""
    text = metadata.get(META_STATE_KEY)
    if text is None:
        return [None] * n_layers
    try:
        entries = json.loads(text)
    except (ValueError, RecursionError):
        entries = None
    if not (isinstance(entries, list) and len(entries) == n_layers and all(
            e is None or (isinstance(e, list) and all(isinstance(x, str) for x in e)) for e in entries)):
        raise ValueError(f"load_prompt_cache: {path!r}: metadata {META_STATE_KEY!r} must be a JSON list of "
                         f"{n_layers} entries (a list of strings or null per layer)")
    return [None if e is None else tuple(e) for e in entries]


def _classes_by_name() -> dict:
    names = {n: c for n, c in vars(mlx_cache).items() if isinstance(c, type) and hasattr(c, "from_state")}
    names.update({c.__name__: c for c in registry.CACHE_CLASSES})  # (kinds registered later included)
    return names


def _missing_entries(state, prefix: str) -> list:
    """Positions in a layer's unflattened state where an array was removed (tree_unflatten leaves ``{}``)."""
    out = []
    if isinstance(state, list):
        for i, s in enumerate(state):
            if isinstance(s, dict) and not s:
                out.append(f"{prefix}.{i}")
            else:
                out.extend(_missing_entries(s, f"{prefix}.{i}"))
    return out


def load_prompt_cache(file_name: str, return_metadata: bool = False, *, calibration=None):
    """Load a prompt-cache file written by `save_prompt_cache` (or by mlx_lm itself).

    Returns the list of caches, and with ``return_metadata=True`` also the metadata exactly as the user
    saved it. Errors: FileNotFoundError / IsADirectoryError for a path that is not a file, ValueError
    naming the file (and the layer, class or array) for anything inside it that does not add up.
    ``calibration``: a `veloxquant_mlx.Calibration` the file's compressed caches must have been built with
    (ValueError naming the file, the layer and both calibrations otherwise). Without it the caches continue
    with the channel weights they were saved with, whatever the model is enabled with.
    """
    path = _check_path(file_name, "load_prompt_cache")
    if not isinstance(return_metadata, bool):
        raise TypeError(f"load_prompt_cache: return_metadata must be a bool, got {type(return_metadata).__name__}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"load_prompt_cache: {path!r} is a directory, not a prompt-cache file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_prompt_cache: no such file {path!r}")
    try:
        arrays, file_meta = mx.load(path, format="safetensors", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(f"load_prompt_cache: {path!r} is not a readable .safetensors file "
                         f"(truncated or corrupt?): {e}") from None
    try:
        metadata, classes, scalars = tree_unflatten(list(file_meta.items()))
        if not isinstance(metadata, dict) or not isinstance(classes, list) or not isinstance(scalars, list):
            raise ValueError
        for pos, kind in scalars[1:]:
            if kind not in ("scalar", "string", "none"):
                raise ValueError
    except (ValueError, TypeError):
        raise ValueError(f"load_prompt_cache: {path!r} has no prompt-cache metadata (is it a prompt cache "
                         "written by save_prompt_cache?)") from None
    for pos, kind in scalars[1:]:
        if pos not in arrays:
            raise ValueError(f"load_prompt_cache: {path!r}: array {pos!r} is missing")
        a = arrays[pos]
        if kind == "scalar":
            arrays[pos] = a.item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in a.tolist())
        else:
            arrays[pos] = None
    states = tree_unflatten(list(arrays.items())) if arrays else []
    if not isinstance(states, list) or len(states) > len(classes):
        raise ValueError(f"load_prompt_cache: {path!r}: the arrays do not match the {len(classes)} layers listed")
    states = states + [[] for _ in range(len(classes) - len(states))]  # layers whose every array is gone
    known = _classes_by_name()
    meta_states = _read_meta_states(metadata, len(classes), path)
    cache = []
    for i, (name, state) in enumerate(zip(classes, states)):
        cls = known.get(name)
        if cls is None:
            raise ValueError(f"load_prompt_cache: {path!r}: layer {i} has unknown cache class {name!r} "
                             f"(known: {sorted(known)})")
        if isinstance(state, dict) and not state:
            state = []  # a layer with no arrays (an empty cache between filled ones), as saved
        missing = _missing_entries(state, str(i))
        if missing:
            raise ValueError(f"load_prompt_cache: {path!r}: layer {i} ({name}): array(s) {missing} missing")
        try:
            with mlx_lm_cache_classes():  # CacheList rebuilds its children by name in mlx_lm's module
                meta_state = meta_states[i]
                cache.append(cls.from_state(state) if meta_state is None else cls.from_state(state, meta_state))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"load_prompt_cache: {path!r}: layer {i} ({name}) refused its state: {e}") from e
    if calibration is not None:
        _check_calibration(path, cache, calibration)
    metadata = {k: v for k, v in metadata.items() if k not in (VERSION_KEY, META_STATE_KEY)}
    return (cache, metadata) if return_metadata else cache


def _check_calibration(path: str, caches: List[Any], calibration) -> None:
    """Every compressed cache of the file was built with ``calibration`` (ValueError naming file and layer)."""
    want = getattr(calibration, "id", None)
    if not isinstance(want, str):
        raise TypeError(f"load_prompt_cache: calibration must be a veloxquant_mlx.Calibration, got "
                        f"{type(calibration).__name__}")
    for i, c in enumerate(caches):
        options = getattr(c, "options", None)
        if options is None or not hasattr(options, "calibration_id"):
            continue  # mlx_lm's own caches and the seed's RVQ cache carry no channel weights
        if options.calibration_id != want:
            raise ValueError(f"load_prompt_cache: {path!r}: layer {i} was saved with "
                             f"{'calibration ' + options.calibration_id if options.calibration_id else 'no calibration'}"
                             f", not calibration {want}: refusing to mix them")
