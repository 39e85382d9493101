"""A tokenizer for mlx_lm's TokenizerWrapper in tests with tiny random models (no files, no network)."""


class FakeTokenizer:
    """Just enough of a tokenizer for mlx_lm's TokenizerWrapper: token i is the text '<i>'."""

    eos_token_id = None
    bos_token = None
    chat_template = None
    all_special_ids = []

    def get_vocab(self):
        return {f"<{i}>": i for i in range(128)}

    def apply_chat_template(self, messages, **kwargs):
        raise NotImplementedError

    def encode(self, text, add_special_tokens=True):
        return [int(t) if t.isdigit() else 0 for t in text.split()]

    def decode(self, ids, **kwargs):
        return "".join(f"<{i}>" for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [f"<{i}>" for i in ids] if isinstance(ids, list) else f"<{ids}>"
