"""Measuring a calibration (`veloxquant_mlx.integration.measure_calibration.calibrate`): the statistics it records are
the model's keys, values and output projection as one plain forward pass sees them, whatever the chunking; the
channel weights follow them (skewed channels weighted down); the text is the caller's tokens or the model's own
answers to fixed prompts; bad arguments are refused naming them."""
from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from veloxquant_mlx.apps.eval.architectures import IdTokenizer
from veloxquant_mlx.integration import measure_calibration
from veloxquant_mlx.integration.calibration import model_fingerprint



def test_calibrate_measures_the_skewed_channels(calibration, skewed):
    wk, wv = calibration.layer_weights(0)
    lk, lv = np.log2(np.array(wk))[0], np.log2(np.array(wv))[0]
    d = skewed.args.head_dim
    hot = list(range(0, 8)) + list(range(d // 2, d // 2 + 8))
    cold = [j for j in range(d) if j not in hot]
    # keys 8x larger where queries are 8x smaller: w^4 = Q/K = 1/4096 relative, i.e. 3 octaves down
    assert lk[hot].mean() < lk[cold].mean() - 2
    assert lv[hot].mean() < lv[cold].mean() - 2
    assert calibration.text["tokens"] == 600 and calibration.model == model_fingerprint(skewed)


def _plain_keys_and_values(model, seqs):
    """Every layer's keys and values (float32, (H, tokens, d)) over ``seqs``, from mlx_lm's plain cache."""
    ks, vs = [[] for _ in model.layers], [[] for _ in model.layers]
    for seq in seqs:
        cache = [KVCache() for _ in model.layers]
        model(mx.array([seq]), cache=cache)
        for i, c in enumerate(cache):
            ks[i].append(c.keys[0, :, : c.offset].astype(mx.float32))
            vs[i].append(c.values[0, :, : c.offset].astype(mx.float32))
    return [mx.concatenate(k, axis=1) for k in ks], [mx.concatenate(v, axis=1) for v in vs]


@pytest.mark.parametrize("chunk", [256, 7])
def test_statistics_are_the_models_keys_values_and_output_projection(tiny_model, random_tokens, chunk):
    seqs = [random_tokens[:90], random_tokens[500:540]]
    cal = measure_calibration.calibrate(tiny_model, seqs, chunk=chunk)
    keys, values = _plain_keys_and_values(tiny_model, seqs)
    a = cal.arrays
    L, H, d = len(tiny_model.layers), 1, 64
    assert all(a[n].shape == (L, H, d) and a[n].dtype == mx.float32 for n in
               ("key_variance", "query_power", "value_power", "output_power", "key_weights", "value_weights"))
    for i, layer in enumerate(tiny_model.layers):
        k, v = keys[i], values[i]
        variance = (k * k).mean(axis=1) - k.mean(axis=1) ** 2
        assert mx.allclose(a["key_variance"][i], variance, rtol=1e-3, atol=1e-5).item(), i
        assert mx.allclose(a["value_power"][i], (v * v).mean(axis=1), rtol=1e-4, atol=1e-6).item(), i
        w = layer.self_attn.o_proj.weight.astype(mx.float32)  # (hidden, query heads x d): 2 query heads per KV head
        assert mx.allclose(a["output_power"][i], (w * w).sum(axis=0).reshape(H, 2, d).sum(axis=1), rtol=1e-5).item()
        assert bool(mx.all(a["query_power"][i] > 0).item())
    assert cal.text == {"source": "user", "description": "token ids given by the caller", "tokens": 130,
                        "sequences": 2, "seconds": cal.text["seconds"]}
    assert cal.power == 0.25 and cal.model == model_fingerprint(tiny_model)


def test_tokens_may_be_one_list_or_an_array_and_power_zero_weighs_nothing(tiny_model, random_tokens):
    one = measure_calibration.calibrate(tiny_model, random_tokens[:64], description="64 random tokens")
    same = measure_calibration.calibrate(tiny_model, mx.array(random_tokens[:64]))
    assert one.text["description"] == "64 random tokens" and one.text["sequences"] == 1
    for name, value in one.arrays.items():
        assert mx.array_equal(value, same.arrays[name]).item(), name
    flat = measure_calibration.calibrate(tiny_model, random_tokens[:64], power=0)
    assert bool(mx.all(flat.arrays["key_weights"] == 1).item()) and bool(mx.all(flat.arrays["value_weights"] == 1).item())


def test_refusals_name_the_argument(tiny_model):
    for tokens in ([], [[1, 2], [3]], [1, True], [1, -2]):
        with pytest.raises(ValueError, match=r"tokens"):
            measure_calibration.calibrate(tiny_model, tokens)
    with pytest.raises(TypeError, match="chunk must be an int"):
        measure_calibration.calibrate(tiny_model, [1, 2, 3], chunk=2.0)
    with pytest.raises(ValueError, match="chunk"):
        measure_calibration.calibrate(tiny_model, [1, 2, 3], chunk=0)
    with pytest.raises(TypeError, match="model must be an mlx_lm model with .layers, got object"):
        measure_calibration.calibrate(object(), [1, 2, 3])
    with pytest.raises(ValueError, match="power"):
        measure_calibration.calibrate(tiny_model, [1, 2, 3], power=float("nan"))


class DigitTokenizer(IdTokenizer):
    """Token i is the text ' i': what the model answers decodes and encodes back to the same ids. No chat template
    (a base model's tokenizer): the prompt is its text."""
    has_chat_template = False

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in re.findall(r"\d+", text)]

    def decode(self, ids, **kwargs):
        return "".join(f" {int(i)}" for i in ids)


class ChatTokenizer(DigitTokenizer):
    """The same, with a chat template: ids 1, the user's ids, 2."""
    has_chat_template = True

    def apply_chat_template(self, messages, add_generation_prompt=False, **kwargs):
        assert add_generation_prompt and [m["role"] for m in messages] == ["user"]
        return [1] + self.encode(messages[0]["content"]) + [2]


@pytest.mark.parametrize("tokenizer", [DigitTokenizer, ChatTokenizer])
def test_default_text_is_the_prompt_and_the_models_own_greedy_answer(tiny_model, tokenizer):
    from mlx_lm.generate import generate_step

    tok = TokenizerWrapper(tokenizer(128))
    tok.has_chat_template = tokenizer.has_chat_template  # (the wrapper takes any non-HF tokenizer for a templated one)
    prompts = ("5 17 3 99", "42 8")
    seqs = measure_calibration.default_calibration_tokens(tiny_model, tok, prompts, tokens_per_prompt=6)
    assert len(seqs) == 2
    for prompt, seq in zip(prompts, seqs):
        ids = [int(t) for t in prompt.split()]
        if tok.has_chat_template:
            ids = [1] + ids + [2]
        greedy = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), tiny_model, max_tokens=6), range(6))]
        assert seq == ids + greedy
    with pytest.raises(ValueError, match="tokens_per_prompt"):
        measure_calibration.default_calibration_tokens(tiny_model, tok, prompts, tokens_per_prompt=0)


def test_key_rotation_probe_is_the_calibration_rule_on_seeded_random_ids(tiny_model, skewed):
    """`probe_key_rotations`: the calibration's per-layer rule (`key_rotations`) on the statistics of `PROBE_TOKENS`
    random ids from `PROBE_SEED` (the same every call); keys whose loud channels the queries do not read are
    flagged on every layer, the plain tiny model on none."""
    from veloxquant_mlx.integration.calibration import key_rotations

    vocab = tiny_model.args.vocab_size
    ids = np.random.default_rng(measure_calibration.PROBE_SEED).integers(0, vocab, measure_calibration.PROBE_TOKENS)
    for model in (tiny_model, skewed):
        a = measure_calibration.calibrate(model, ids.tolist()).arrays
        probed = measure_calibration.probe_key_rotations(model)
        assert probed == key_rotations(a["query_power"], a["key_variance"]) == measure_calibration.probe_key_rotations(model)
        assert len(probed) == len(model.layers)
    assert measure_calibration.probe_key_rotations(skewed) == ("none",) * len(skewed.layers)
    assert measure_calibration.probe_key_rotations(tiny_model) == (None,) * len(tiny_model.layers)


def test_key_rotation_probe_refuses_a_model_it_cannot_measure(tiny_model, monkeypatch):
    monkeypatch.setattr(measure_calibration, "vocab_size", lambda model: None)
    with pytest.raises(ValueError, match="states no vocab_size"):
        measure_calibration.probe_key_rotations(tiny_model)
