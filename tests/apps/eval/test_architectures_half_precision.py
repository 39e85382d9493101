"""Every architecture the installed mlx_lm ships in float16 and bfloat16, on a tiny random model
(veloxquant_mlx.apps.eval.architectures): exact storage is as close to the same weights in float32 as mlx_lm's own cache in
that dtype, the default configuration runs. (Apart from tests/apps/eval/test_architectures.py, float32, so that the
two run on separate pytest-xdist workers: each takes minutes.)"""
import pytest

from veloxquant_mlx.apps.eval import architectures as arch
from veloxquant_mlx.apps.eval.tiny_configs import CONFIGS, NEEDS

# architectures with attention every dtype must cover (the representative set: dense, GQA with windows,
# MLA latents, a hybrid, shared keys/values); MoE models cannot run in half precision on MLX's CPU (GatherMM)
REPRESENTATIVE = ("llama", "qwen3", "gemma3", "deepseek_v2", "qwen3_5", "gemma3n", "afm7", "gemma4_text")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_architectures_half_precision(dtype):
    results = {name: arch.check(name, dtype) for name in CONFIGS}
    bad = {n: f"{r.status}: {r.detail}" for n, r in results.items() if not r.ok}
    assert not bad, bad
    ran = {n for n, r in results.items() if r.status != "not run"}
    assert set(REPRESENTATIVE) <= ran, set(REPRESENTATIVE) - ran
    for n, r in results.items():  # what did not run is mlx_lm's own failure on this machine, or needs Metal
        if r.status == "not run":
            assert "mlx_lm's own caches fail here" in r.detail or n in NEEDS, (n, r.detail)
    assert len(ran) >= 60, f"only {len(ran)} architectures ran in {dtype}"
