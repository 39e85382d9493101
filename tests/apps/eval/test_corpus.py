"""The evaluation corpus (`veloxquant_mlx.apps.eval.corpus`): prose kept and code dropped from the Debian Reference's
HTML, a clear error naming the package when it is missing, the tokens deterministic; the text prefix a tokenizer
adds (a BOS) read from the tokenizer and carried by the tokens."""
from __future__ import annotations

import pytest

from veloxquant_mlx.apps.eval import corpus as corpus_mod
from veloxquant_mlx.apps.eval.corpus import CorpusTokens, text_prefix, tokenize_text
from _eval_helpers import BOS, TINY_VOCAB, BosEosTokenizer, BosTokenizer, ByteTokenizer


# ----------------------------------------------------------------------------- corpus
def test_html_paragraphs_keep_prose_drop_code():
    html = (
        "<html><head><title>t</title></head><body>"
        "<p>This is a real paragraph of English prose with <em>some</em> words.</p>"
        "<pre>$ sudo apt-get install something long enough to count as words</pre>"
        "<p><code>apt-get install foo bar baz qux quux</code> run</p>"
        "<ul><li><p>A list item that also reads like normal prose text.</p></li></ul>"
        "<p>too short</p></body></html>"
    )
    paras = corpus_mod.html_paragraphs(html)
    assert paras == [
        "This is a real paragraph of English prose with some words.",
        "A list item that also reads like normal prose text.",
    ]


def test_missing_corpus_says_how_to_install(tmp_path):
    with pytest.raises(corpus_mod.CorpusMissing, match="apt-get install debian-reference-en"):
        corpus_mod.corpus_files(str(tmp_path))


@pytest.mark.model
def test_corpus_is_large_and_deterministic(smollm2, corpus_ids):
    assert len(corpus_ids) >= 100_000
    corpus_mod.corpus_text.cache_clear()
    assert corpus_mod.corpus_tokens(smollm2[1])[:5000] == corpus_ids[:5000]


def test_text_prefix_reads_the_tokenizer():
    assert text_prefix(ByteTokenizer(TINY_VOCAB)) == ()
    assert text_prefix(BosTokenizer(TINY_VOCAB)) == (BOS,)
    assert text_prefix(BosEosTokenizer(TINY_VOCAB)) == (BOS,)  # an EOS after the text is no prefix
    ids = tokenize_text(BosTokenizer(TINY_VOCAB), "hello world")
    assert isinstance(ids, CorpusTokens) and ids.prefix == (BOS,) and BOS not in ids[:5]
    assert ids[2:7].prefix == (BOS,) and list(ids[2:7]) == list(ids)[2:7]  # a slice keeps the prefix
    assert tokenize_text(ByteTokenizer(TINY_VOCAB), "hello").prefix == ()
