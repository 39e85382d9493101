"""``max_tokens`` past the served model's context (`veloxquant_mlx.apps.server`): refused in a request (HTTP 400 naming
the field and the context, when only config.json states it) and at start for the server's own default."""
from __future__ import annotations

import argparse
import http.client
import json

import mlx.core as mx
import pytest


def _tiny_llama_without_context():
    """conftest's tiny llama, but its ModelArgs state no context (as Mixtral's, Gemma 2's... drop it)."""
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5, vocab_size=128,
                     max_position_embeddings=None, tie_word_embeddings=True)
    model = Model(args)
    mx.eval(model.parameters())
    return model


def _send(port, path, body):
    """(status, decoded JSON) of one POST, as tests/apps/test_server_bad_input.py sends them."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_server_refuses_max_tokens_past_a_context_only_config_json_states(tmp_path, monkeypatch):
    from veloxquant_mlx.apps import server as vs
    from veloxquant_mlx.apps.models import load_model, loader

    model = _tiny_llama_without_context()
    # an mlx_lm directory: its config.json says 256, its ModelArgs kept nothing of it
    monkeypatch.setattr(loader, "mlx_load", lambda path, return_config=False: (
        model, None, {"model_type": "llama", "max_position_embeddings": 256}))
    model, tokenizer = load_model(str(tmp_path))
    args = vs.add_serve_arguments(argparse.ArgumentParser()).parse_args(["--preset", "tq-mse-k4v4", "--max-tokens",
                                                                         "7"])
    handle = vs.start_server(args, model=model, tokenizer=tokenizer, port=0)
    try:
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions",
                                                                   {"messages": [{"role": "user", "content": "hi"}]})):
            for name in ("max_tokens", "max_completion_tokens"):
                status, payload = _send(handle.port, path, dict(body, **{name: 1000}))
                error = payload["error"]
                assert status == 400 and error["param"] == name, payload
                assert f"{name} must be at most 255: this model's context is 256 tokens" in error["message"], error
    finally:
        handle.close()


def test_server_default_max_tokens_past_the_context_is_refused_at_start(tiny_model):
    from veloxquant_mlx.apps import server as vs

    args = vs.add_serve_arguments(argparse.ArgumentParser()).parse_args(["--max-tokens", "5000"])
    try:
        handle = vs.start_server(args, model=tiny_model, tokenizer=None, port=0)
    except ValueError as e:
        assert "--max-tokens must be at most 4095: this model's context is 4096" in str(e), e
    else:  # a server that started must not outlive the test
        handle.close()
        pytest.fail("a default --max-tokens past the model's context was accepted")
