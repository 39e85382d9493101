"""`veloxquant_mlx.apps.distributed` in this one process, without ``mlx.launch``: `shard`'s checks before it splits a
model, what it does on one rank, and the line `rank_summary` logs (the launched ranks: test_distributed.py)."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.apps import distributed
from veloxquant_mlx.apps.eval.specs import resolve_spec


class FakeGroup:
    """A launched world of ``n`` ranks as `shard` and `rank_summary` see it (nothing is communicated)."""

    def __init__(self, n: int, rank: int = 0):
        self.n, self.r = n, rank

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def test_one_rank_leaves_the_model_as_it_is(tiny_model):
    before = {k: v for k, v in tiny_model.parameters().items()}
    assert distributed.shard(tiny_model, FakeGroup(1)) is tiny_model
    assert distributed.shard(tiny_model) is tiny_model  # the default world of this process: one rank
    assert tiny_model.parameters().keys() == before.keys()
    assert tiny_model.layers[0].self_attn.n_kv_heads == 1  # nothing split


def test_heads_that_do_not_divide_are_refused_before_anything_is_split(tiny_model):
    # conftest's tiny llama: 2 query heads and 1 KV head
    with pytest.raises(ValueError, match=r"over 3 ranks splits attention heads across ranks: the model has 2 query "
                                         r"and 1 KV heads, which must both divide by 3"):
        distributed.shard(tiny_model, FakeGroup(3))
    with pytest.raises(ValueError, match="over 2 ranks"):
        distributed.shard(tiny_model, FakeGroup(2))  # 1 KV head cannot be halved
    assert tiny_model.layers[0].self_attn.n_kv_heads == 1 and tiny_model.layers[0].self_attn.n_heads == 2


def test_a_model_without_the_parallelism_asked_for_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"has no pipeline parallelism in mlx_lm .*run without --pipeline"):
        distributed.shard(tiny_model, FakeGroup(2), pipeline=True)  # mlx_lm's llama has no model.pipeline

    class NoShard:
        model_type = "toy"

    with pytest.raises(ValueError, match=r"model type 'toy' has no tensor parallelism in mlx_lm .*try --pipeline"):
        distributed.shard(NoShard(), FakeGroup(2))


def test_rank_summary_states_what_this_rank_holds_and_its_bytes(tiny_model):
    # one layer of the plain cache holds float32 keys and values: 2 x 1 KV head x 64 x 4 bytes per token
    line = distributed.rank_summary(tiny_model, lambda m: [KVCache() for _ in m.layers], FakeGroup(1))
    assert line == "rank 0/1: 1 KV heads, 2 layers; KV bytes per token 1024 (512.0 per layer)"
    ours = distributed.rank_summary(tiny_model, resolve_spec("tq-affine-k8v8").make_cache, FakeGroup(1))
    per_layer = float(ours.rsplit("(", 1)[1].split()[0])
    assert ours.startswith("rank 0/1: 1 KV heads, 2 layers; KV bytes per token ") and 0 < per_layer < 512 / 3
    # another rank of a larger world names itself and the tensor-parallel share it holds
    other = distributed.rank_summary(tiny_model, lambda m: [KVCache() for _ in m.layers], FakeGroup(4, rank=2))
    assert other.startswith("rank 2/4: tensor parallel, 1 of 1 KV heads, 2 layers; ")
    assert mx.distributed.init().size() == 1  # (this test process is one rank)
