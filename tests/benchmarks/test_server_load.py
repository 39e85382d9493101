"""benchmarks/server_load.py's pieces for long conversations (``--distinct-contexts``): each request its own context,
slices of one offline text that share no prefix; a server process's peak resident memory read from /proc."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server_load():
    """benchmarks/server_load.py as a module, loaded from its file (its ``_common`` from the same folder)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "benchmarks"))
        spec = importlib.util.spec_from_file_location("benchmarks_server_load", ROOT / "benchmarks" / "server_load.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


class _Chars:
    """A tokenizer of one id per character (the slices are then exact)."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_each_request_gets_its_own_context_slice(server_load, monkeypatch):
    from veloxquant_mlx.apps.eval import corpus

    text = "".join(chr(97 + i % 26) for i in range(1000))
    monkeypatch.setitem(corpus.CORPORA, "debian-reference", lambda: text)
    contexts = server_load.distinct_contexts(_Chars(), 3, 100)
    assert contexts == [text[i * 100: (i + 1) * 100] + "\n\n" for i in range(3)]
    bodies = [server_load._body(i, contexts, 8)["messages"][0]["content"] for i in range(4)]
    assert [b[:102] for b in bodies] == contexts + contexts[:1]
    assert bodies[1].endswith(server_load.QUESTIONS[1])
    shared = server_load._body(2, "ctx. ", 8)["messages"][0]["content"]
    assert shared == "ctx. " + server_load.QUESTIONS[2]
    with pytest.raises(ValueError, match="fewer than 20 x 100"):
        server_load.distinct_contexts(_Chars(), 20, 100)


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_peak_rss_of_a_live_process_and_none_for_a_gone_one(server_load):
    if not os.path.exists(f"/proc/{os.getpid()}/status"):
        pytest.skip("no /proc here")
    import mmap

    before = _rss_mib()
    fresh = mmap.mmap(-1, 64 * 2**20)  # new anonymous pages (malloc may hand back memory already resident)
    for i in range(0, len(fresh), 4096):
        fresh[i] = 1  # touched: resident
    now = _rss_mib()
    assert now >= before + 60
    assert server_load.peak_rss_mib(os.getpid()) >= now  # the peak is at least what is resident now
    assert server_load.peak_rss_mib(2**31 - 1) is None
    fresh.close()


def test_presets_choose_the_servers_plain_first(server_load):
    configs = server_load.server_configs(["tq-4b", "tq-affine-k8v4"])
    assert [label for label, _ in configs] == ["plain kv, batched", "tq-4b, batched", "tq-affine-k8v4, batched",
                                               "tq-affine-k8v4, one at a time"]
    assert configs[1][1] == ["--preset", "tq-4b"]
    assert server_load.server_configs([server_load.COMPRESSED]) == server_load.DEFAULT_CONFIGS
    assert ("ours tq-4b", "tq-4b") in server_load.capacity_caches(["tq-4b"])
    for bad in (["kv"], ["tq-9b"], []):
        with pytest.raises(SystemExit, match="--presets"):
            server_load.server_configs(bad)
