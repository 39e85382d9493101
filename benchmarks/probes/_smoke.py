"""What the probes' ``--smoke`` runs on: a tiny random mlx_lm llama and a byte tokenizer (no download, no weights).

A helper, not a probe: ``--smoke`` runs a probe's code paths end to end in seconds (tests/benchmarks/test_probes.py
runs every probe so), its figures meaningless. Import it inside the function that needs it, after
`veloxquant_mlx.apps.blas.ensure_openblas` (building the model imports MLX).
"""
from __future__ import annotations

VOCAB = 128


class ByteTokenizer:
    """One id per UTF-8 byte (mod the vocabulary), no special tokens; a chat template that joins the messages; just
    enough besides for mlx_lm's ``TokenizerWrapper`` (``mlx_lm.generate``, as the default calibration text runs it)."""

    has_chat_template = True
    chat_template = None
    eos_token_id, bos_token, eos_token_ids, all_special_ids = None, None, [], []

    def __init__(self, vocab_size: int = VOCAB):
        self.vocab_size = vocab_size

    def encode(self, text, add_special_tokens=True):
        return [b % self.vocab_size for b in str(text).encode("utf-8")]

    def decode(self, ids, **kwargs):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")

    def get_vocab(self):
        return {chr(i): i for i in range(self.vocab_size)}

    def convert_ids_to_tokens(self, ids):
        return [chr(int(i)) for i in ids] if isinstance(ids, list) else chr(int(ids))

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


def tiny_model(layers: int = 3, seed: int = 1234):
    """(model, tokenizer): mlx_lm's llama with ``layers`` layers, hidden 64, 3 query heads per KV head (as SmolLM2),
    one KV head of head_dim 64 (MLX's quantizers' group), random weights; `ByteTokenizer`."""
    import mlx.core as mx
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(seed)
    model = Model(ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
                            num_attention_heads=3, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5,
                            vocab_size=VOCAB, max_position_embeddings=4096, rope_theta=100000.0,
                            tie_word_embeddings=True))
    mx.eval(model.parameters())
    model.eval()
    return model, ByteTokenizer(VOCAB)
