"""Which models the routing reaches (`veloxquant_mlx.integration.scan`), read statically from mlx_lm's model files:
a model calling ``mx.fast.scaled_dot_product_attention`` itself is not routable; a model computing on the fetched
keys / values (a cast, a tile of the heads, its own attention) or holding MLA latents gets real arrays; one head_dim
or several; comments and docstrings never count, only code."""
from __future__ import annotations

import ast
import importlib
import textwrap

import pytest

from veloxquant_mlx.apps.eval import architectures as arch
from veloxquant_mlx.integration import routing, scan


def _module(name):
    importlib.import_module(f"mlx_lm.models.{name}")
    return f"mlx_lm.models.{name}"


@pytest.mark.parametrize("name, direct, reads, members", [
    ("llama", False, False, False),
    ("plamo2", True, False, False),  # calls mx.fast.scaled_dot_product_attention itself
    ("deepseek_v41", True, False, False),
    ("plamo", False, True, False),  # tiles the fetched heads
    ("phi3small", False, True, False),  # block-sparse attention of its own on the fetched keys
    ("deepseek_v32", False, True, True),  # a sparse-attention indexer reading cache[1].keys
])
def test_model_files_read_from_their_code(name, direct, reads, members):
    module = _module(name)
    assert scan._calls_fast_sdpa_directly(module) is direct
    assert scan.reads_fetched_arrays(module) is reads
    assert scan._reads_member_arrays(module) is members


def test_an_unknown_module_is_taken_for_the_worst():
    assert scan._calls_fast_sdpa_directly("mlx_lm.models.no_such_model") is True
    assert scan.reads_fetched_arrays("mlx_lm.models.no_such_model") is True


def _reads(source: str) -> bool:
    func = ast.parse(textwrap.dedent(source)).body[0]
    return scan._fetch_reads(func)


def test_what_counts_as_computing_on_the_fetched_arrays():
    assert not _reads('''
        def attend(self, q, k, v, cache):
            keys, values = cache.update_and_fetch(k, v)
            # keys.astype(mx.float16) in a comment does not count
            out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=self.scale, mask=None)
            return out, keys.shape[2]''')
    assert not _reads('''
        def fetch(cache, k, v):
            keys, values = cache.update_and_fetch(k, v)
            return keys, values''')
    assert _reads('''
        def attend(q, k, v, cache):
            keys, values = cache.update_and_fetch(k, v)
            keys = keys.astype(mx.float16)
            return scaled_dot_product_attention(q, keys, values, cache=cache)''')
    assert _reads('''
        def attend(q, k, v, cache):
            keys, values = cache.update_and_fetch(k, v)
            return scaled_dot_product_attention(q, mx.tile(keys, (1, 2, 1, 1)), values, cache=cache)''')
    assert not _reads('''
        def attend(q, k, v, cache):
            if cache is not None:
                keys, values = cache.update_and_fetch(k, v)
            else:
                keys, values = mx.tile(k, (1, 2, 1, 1)), v
            return scaled_dot_product_attention(q, keys, values, cache=cache)''')  # the other branch runs instead


@pytest.mark.parametrize("name, routable, real, latent, head_dim", [
    ("llama", True, False, False, 32),
    ("gemma3_text", True, False, False, 32),
    ("qwen3_5", True, False, False, 32),  # a hybrid: its text model's head_dim
    ("deepseek_v2", True, True, True, None),  # MLA latents: real arrays, no one head_dim
    ("gemma4_text", True, False, False, None),  # per-layer head dims
    ("plamo2", False, False, False, None),
])
def test_models_of_each_kind(name, routable, real, latent, head_dim):
    model = arch.build(name)
    assert scan.attention_is_routable(model) is routable
    assert scan.fetches_real_arrays(model) is real and scan.latent_attention(model) is latent
    assert scan.uniform_head_dim(model) == head_dim


def test_routable_whether_the_routing_is_on_or_off():
    model = arch.build("llama")
    with routing.use_packed_attention():  # the model's module then holds the replacement
        assert scan.attention_is_routable(model)
    assert scan.attention_is_routable(model) and not scan.attention_is_routable(object())
