"""Which models the routing reaches: static reads of a model's mlx_lm modules (their compiled bytecode and their
syntax trees, never their text) that decide whether its caches may hand out placeholders to the routed attention
(`attention_is_routable`) or must hand out real arrays (`fetches_real_arrays`: MLA latents, models computing on the
fetched keys / values), and whether it has one head_dim (`uniform_head_dim`). The per-module reads are cached.

`attention_is_routable` reads the routing's state under its lock, through the `routing` module (never a copy).
"""
from __future__ import annotations

import ast
import dis
import functools
import inspect
import sys
from typing import Optional

from mlx_lm.models import base as mlx_base

from veloxquant_mlx.integration import routing
from veloxquant_mlx.integration.routing import _NAME, packed_scaled_dot_product_attention
from veloxquant_mlx.integration.model_shape import head_dim as model_head_dim


def _code_objects(code):
    yield code
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _code_objects(const)


@functools.lru_cache(maxsize=None)
def _calls_fast_sdpa_directly(module_name: str) -> bool:
    """Whether a model module's code reads ``<x>.fast.scaled_dot_product_attention`` (the routing cannot see it).

    Reads the compiled bytecode of every function in the module (not its source text, where comments and
    docstrings would count): an attribute load of ``fast`` followed by one of ``scaled_dot_product_attention``.
    """
    module = sys.modules.get(module_name)
    if module is None:
        return True  # unknown module: assume the worst, caches then decode as usual
    codes = []
    for value in vars(module).values():
        for fn in [value] + (list(vars(value).values()) if inspect.isclass(value) else []):
            fn = getattr(fn, "__func__", fn)
            if inspect.isfunction(fn) and fn.__module__ == module_name:
                codes.extend(_code_objects(fn.__code__))
    for code in codes:
        previous = None
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                if previous == "fast" and ins.argval == _NAME:
                    return True
                previous = ins.argval
            elif ins.opname not in ("CACHE", "EXTENDED_ARG"):
                previous = None
    return False


_SHAPE_ATTRIBUTES = ("shape", "dtype", "ndim", "size")


def _fetch_reads(func: ast.AST) -> bool:
    """Whether ``func`` (an ``ast.FunctionDef``) uses what ``... = <cache>.update_and_fetch(...)`` returned for
    anything but the keys / values of a ``scaled_dot_product_attention`` call, its shape, or its return value."""
    parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
    for stmt in ast.walk(func):
        if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "update_and_fetch"):
            continue
        names = {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        skip = set()  # the other branch of the ``if`` holding the fetch runs instead of it
        node = stmt
        while node in parents:
            parent = parents[node]
            if isinstance(parent, ast.If) and node in parent.body:
                skip.update(ast.walk(ast.Module(body=parent.orelse, type_ignores=[])))
            node = parent
        skip.update(ast.walk(stmt))  # (the fetch's own arguments and targets)
        for use in ast.walk(func):
            if not isinstance(use, ast.Name) or use.id not in names or use in skip or \
                    (use.lineno, use.col_offset) <= (stmt.lineno, stmt.col_offset):
                continue
            if isinstance(use.ctx, ast.Store):
                return True
            up = parents.get(use)
            while isinstance(up, ast.Tuple):
                up = parents.get(up)
            if isinstance(up, ast.keyword):
                up = parents.get(up)
            if isinstance(up, ast.Return):
                continue
            if isinstance(up, ast.Attribute) and up.attr in _SHAPE_ATTRIBUTES:
                continue
            callee = getattr(up, "func", None) if isinstance(up, ast.Call) else None
            name = getattr(callee, "attr", None) or getattr(callee, "id", None)
            if name == _NAME and use not in ast.walk(callee):
                continue
            return True
    return False


@functools.lru_cache(maxsize=None)
def reads_fetched_arrays(module_name: str) -> bool:
    """Whether a model module computes on what its caches' ``update_and_fetch`` returned before (or instead of)
    mlx_lm's ``scaled_dot_product_attention``: a dtype cast, ``mx.tile`` of the heads (plamo), an attention of its
    own (phi3small's block-sparse layers), an MLA latent. Its caches must then hand out real arrays. Read from the
    module's source (its syntax tree: comments do not count); a module without source counts as reading them."""
    module = sys.modules.get(module_name)
    try:
        tree = ast.parse(inspect.getsource(module))
    except (TypeError, OSError, SyntaxError):
        return True
    return any(_fetch_reads(f) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))


@functools.lru_cache(maxsize=None)
def _reads_member_arrays(module_name: str) -> bool:
    """Whether a model module reads the raw ``keys`` / ``values`` of a `CacheList` member past the first
    (``cache[1].keys``: the sparse-attention indexers of deepseek_v32, glm_moe_dsa, minimax_m3_vl)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules.get(module_name)))
    except (TypeError, OSError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("keys", "values") and \
                isinstance(node.value, ast.Subscript) and isinstance(node.value.slice, ast.Constant) and \
                isinstance(node.value.slice.value, int) and node.value.slice.value >= 1:
            return True
    return False


def _model_modules(model) -> set:
    names = {type(model).__module__}
    if callable(getattr(model, "modules", None)):
        names.update(type(m).__module__ for m in model.modules())
    return {n for n in names if n.startswith("mlx_lm.models.") and n not in ("mlx_lm.models.base",)}


def fetches_real_arrays(model) -> bool:
    """Whether ``model``'s caches must hand out their history as real arrays (decoded), not placeholders: an MLA
    model (`latent_attention`) or one whose code computes on the fetched keys / values (`reads_fetched_arrays`)."""
    return latent_attention(model) or any(reads_fetched_arrays(n) for n in _model_modules(model))


def attention_is_routable(model) -> bool:
    """Whether ``model``'s attention goes through mlx_lm's ``scaled_dot_product_attention`` everywhere.

    Static counterpart of `routes_model` (which needs the routing on): the mlx_lm model files of ``model`` and its
    submodules must hold that function (original or the replacement) and none may call
    ``mx.fast.scaled_dot_product_attention`` directly (deepseek_v41, muse_spark, plamo2 in mlx_lm 0.32). Only then
    may caches return placeholders to it.
    """
    names = _model_modules(model)
    # Under the lock: install / uninstall patch the modules one at a time, and a view taken half-way (base patched,
    # the model's file not yet) said "not routable", so another thread's caches were built without routing.
    with routing._lock:
        targets = (routing._original if routing._depth else getattr(mlx_base, _NAME, None),
                   packed_scaled_dot_product_attention)
        holders = [n for n in names if getattr(sys.modules.get(n), _NAME, None) in targets]
    routing._drain()  # releases a finalizer queued while this thread held the lock
    return bool(holders) and not any(_calls_fast_sdpa_directly(n) for n in names)


def uniform_head_dim(model) -> Optional[int]:
    """The model's head_dim (`veloxquant_mlx.integration.model_shape.head_dim`) when every layer's keys and values have it; None
    for per-layer head dims (Gemma 4's global layers), MLA latents, or a model that does not say."""
    d = model_head_dim(model)
    if d is None or fetches_real_arrays(model):
        return None
    modules = model.modules() if callable(getattr(model, "modules", None)) else []
    dims = {m.head_dim for m in modules if isinstance(getattr(m, "head_dim", None), int)}
    return d if dims <= {d} else None


def latent_attention(model) -> bool:
    """Whether ``model`` has MLA layers (DeepSeek V2/V3, Kimi, GLM-4 lite, ...: an attention module with a
    ``kv_lora_rank``): their caches hold a latent and a RoPE part from which the layer builds its keys and values,
    so the caches must hand out real arrays."""
    modules = model.modules() if callable(getattr(model, "modules", None)) else []
    return any(isinstance(getattr(m, "kv_lora_rank", None), int) for m in modules)
