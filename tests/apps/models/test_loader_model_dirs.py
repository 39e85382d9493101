"""`veloxquant generate --model DIR` and `veloxquant serve --model DIR` on local mlx_lm model directories.

Each directory is what mlx_lm's own conversion writes (config.json, model.safetensors + its index, tokenizer.json,
tokenizer_config.json) for a tiny random model of one architecture (`veloxquant_mlx.apps.eval.tiny_configs`): dense
(llama, qwen3), sliding windows (gemma3_text), MoE (mixtral), MLA (deepseek_v2), linear attention beside attention
(qwen3_5). The tokenizer is built offline with `tokenizers`: nothing is downloaded.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from veloxquant_mlx.apps.models import loader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
ARCHITECTURES = ("llama", "qwen3", "gemma3_text", "mixtral", "deepseek_v2", "qwen3_5")
# dense, MoE, hybrid, and MLA (whose caches do not merge: the server answers one request after another)
SERVED = ("llama", "mixtral", "qwen3_5", "deepseek_v2")
VOCAB = 128  # every tiny configuration's vocab_size
SPECIALS = ("<unk>", "<s>", "</s>")
# A Jinja template the tokenizer renders itself, so `generate` (without --raw) and chat/completions use it.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def _tokenizer_files(folder) -> None:
    """A character-level tokenizer of exactly ``VOCAB`` ids: the specials, printable ASCII, then Latin-1 letters (so
    every id the random model picks decodes to text); no merges, pieces joined without spaces."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    chars = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0xC0, 0x100)]
    vocab = {t: i for i, t in enumerate(list(SPECIALS) + chars[:VOCAB - len(SPECIALS)])}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIALS))
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
              "eos_token": "</s>", "model_max_length": 1024, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _write_model_dir(folder, name: str) -> None:
    """``name``'s tiny random model saved as mlx_lm saves a converted model, with the tokenizer files."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from veloxquant_mlx.apps.eval.tiny_configs import CONFIGS

    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(0)
    config = dict(CONFIGS[name])
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(folder, model)
    save_config(config, folder / "config.json")
    _tokenizer_files(folder)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """architecture -> its model directory (written once for the module)."""
    root = tmp_path_factory.mktemp("model_dirs")
    dirs = {}
    for name in ARCHITECTURES:
        dirs[name] = root / name
        _write_model_dir(dirs[name], name)
    return dirs


def _env():
    # offline: a local directory must load without the Hugging Face hub
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def _veloxquant(*argv):
    return [sys.executable, "-m", "veloxquant_mlx", *map(str, argv)]


def test_directories_load_back_with_mlx_lm(model_dirs):
    """The fixture writes what `mlx_lm.load` reads: a broken directory would fail every CLI test for the wrong
    reason."""
    from mlx_lm import load

    model, tok = load(str(model_dirs["llama"]))
    assert model.args.vocab_size == VOCAB and len(tok.vocab) == VOCAB
    assert tok.eos_token_ids == {SPECIALS.index("</s>")} and tok.has_chat_template
    assert tok.decode(tok.encode("hello", add_special_tokens=False)) == "hello"


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3_5"])
def test_load_model_reads_a_directory_and_keeps_its_stated_context(model_dirs, name):
    """In process: `load_model(DIR)` gives mlx_lm's model and tokenizer, and the context config.json states even
    where the architecture's ModelArgs drop it (mixtral's) or keep it in ``text_config`` (qwen3_5's)."""
    from veloxquant_mlx.apps.eval.tiny_configs import CONFIGS

    model, tok = loader.load_model(str(model_dirs[name]))
    config = CONFIGS[name]
    stated = config.get("max_position_embeddings") or config["text_config"]["max_position_embeddings"]
    assert loader.max_context(model) == stated == 1024
    assert tok.decode(tok.encode("hello", add_special_tokens=False)) == "hello"
    assert len(model.layers) == config.get("num_hidden_layers", config.get("text_config", {}).get("num_hidden_layers"))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_generate_on_model_dir(model_dirs, name):
    run = subprocess.run(_veloxquant("generate", "--model", model_dirs[name], "--prompt", "hello",
                                     "--max-tokens", 4),
                         capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert run.stdout.strip(), run.stderr[-3000:]  # the streamed answer
    assert "generated" in run.stderr and " tok at " in run.stderr, run.stderr[-3000:]  # the closing statistics


@pytest.mark.parametrize("name", ("llama", "qwen3_5"))
def test_generate_raw_prompts_batched_on_model_dir(model_dirs, name):
    """Several prompts without the chat template go through mlx_lm's BatchGenerator (the hybrid's linear-attention
    state batched beside the compressed attention caches)."""
    run = subprocess.run(_veloxquant("generate", "--model", model_dirs[name], "--raw", "--prompt", "hello",
                                     "--prompt", "world", "--max-tokens", 4),
                         capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = [line for line in run.stdout.splitlines() if line.startswith(("[1] ", "[2] "))]
    assert sorted(a[:4] for a in answers) == ["[1] ", "[2] "], run.stdout
    assert "2 prompts batched" in run.stderr, run.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, json.loads(r.read())


@pytest.mark.parametrize("name", SERVED)
def test_serve_on_model_dir(model_dirs, name):
    proc = subprocess.Popen(_veloxquant("serve", "--model", model_dirs[name], "--port", _free_port(),
                                        "--max-tokens", 4),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=_env())
    lines, url = [], None
    try:
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:  # exited before listening
                break
            lines.append(line)
            if "listening on" in line:
                url = line.split("listening on ", 1)[1].split()[0]
        assert url, "".join(lines)[-3000:]
        status, reply = _post(url + "/v1/chat/completions", {
            "model": str(model_dirs[name]), "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert status == 200, reply
        choice = reply["choices"][0]
        assert choice["message"]["content"], reply
        assert 0 < reply["usage"]["completion_tokens"] <= 4, reply
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "veloxquant serve: stopped" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
