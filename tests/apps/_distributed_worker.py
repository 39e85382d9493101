"""Run by tests/apps/test_distributed.py under ``mlx.launch`` (each rank runs this file); not a test module itself.

    _distributed_worker.py CASE OUT_DIR [--single]    CASE: tensor (tiny llama, 4 KV heads) | pipeline (tiny qwen2, 4 layers)

Every rank: the same seeded tiny model, sharded (`veloxquant_mlx.apps.distributed.shard`), `enable`d, then
teacher-forced logits through mlx_lm's own cache path, a prompt-cache file saved and loaded by the rank, and the
continuation from the file against the live caches. Rank 0 writes ``OUT_DIR/result.npz``; each rank writes
``OUT_DIR/rank<r>.json`` (its summary line and facts). ``--single``: the same model in one process (the reference).
"""
from __future__ import annotations

import copy
import json
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # (as tests/conftest.py: one thread, bit-for-bit comparable)
from veloxquant_mlx.apps.blas import load_openblas_global  # noqa: E402 - imports no MLX

load_openblas_global()  # Debian's OpenBLAS where installed, as the apps' ranks get it (`ensure_openblas`)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

OPTIONS = dict(k_bits=8, v_bits=8, codec="affine_block", sink=4)
PROMPT = [int(t) for t in np.random.default_rng(7).integers(1, 120, 100)]  # > one 64-token key block
STEPS = 4


def tiny(kind: str):
    from mlx_lm.models import llama, qwen2

    mx.random.seed(0)
    common = dict(hidden_size=256, intermediate_size=256, num_attention_heads=8, vocab_size=128, rms_norm_eps=1e-5)
    if kind == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", num_hidden_layers=2, num_key_value_heads=4, **common))
    else:
        model = qwen2.Model(qwen2.ModelArgs(model_type="qwen2", num_hidden_layers=4, num_key_value_heads=2,
                                            tie_word_embeddings=True, **common))
    mx.eval(model.parameters())
    return model


def logits_of(model, caches, tokens):
    out = [model(mx.array([PROMPT]), cache=caches)[0, -1]]
    for t in tokens:
        out.append(model(mx.array([[t]]), cache=caches)[0, -1])
    return mx.stack(out)


def main(case: str, out_dir: str, single: bool = False) -> int:
    from mlx_lm.models.cache import make_prompt_cache

    import veloxquant_mlx as vq
    from veloxquant_mlx.apps.distributed import rank_summary, shard

    group = None if single else mx.distributed.init()
    rank = group.rank() if group is not None else 0
    model = tiny("qwen2" if case == "pipeline" else "llama")
    try:
        if group is not None:
            shard(model, group, pipeline=case == "pipeline")
    except ValueError as e:
        print(f"rank {rank}: {e}", file=sys.stderr, flush=True)
        return 3
    vq.enable(model, **OPTIONS)
    summary = rank_summary(model, lambda m: make_prompt_cache(m), group)
    print(summary, file=sys.stderr, flush=True)
    caches = make_prompt_cache(model)
    tokens = PROMPT[:STEPS]
    logits = logits_of(model, caches, tokens)
    mx.eval(logits)  # on every rank: collectives inside must run in the same order everywhere
    # This rank's prompt-cache file: save, load, and continue both ways.
    path = os.path.join(out_dir, f"rank{rank}.safetensors")
    vq.save_prompt_cache(path, caches)
    loaded, live = vq.load_prompt_cache(path), copy.deepcopy(caches)
    nxt = [model(mx.array([[5]]), cache=c)[0, -1] for c in (live, loaded)]
    facts = {"summary": summary, "n_caches": len(caches), "kinds": sorted({type(c).__name__ for c in caches}),
             "kv_heads": [c.rows.heads for c in caches],
             "file_continues_exactly": bool(mx.array_equal(nxt[0], nxt[1])),
             "nbytes": sum(c.nbytes for c in caches)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    if rank == 0:
        np.savez(os.path.join(out_dir, "result.npz"), logits=np.array(logits.astype(mx.float32)))
    vq.disable(model)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], single="--single" in sys.argv[3:]))
