"""Evaluation corpus: English prose paragraphs of the Debian Reference manual (``debian-reference-en``).

The text of block elements (paragraphs, list items, table cells, headings) is extracted with
the stdlib ``html.parser``; ``<pre>`` code blocks are skipped and blocks that are mostly
``<code>`` or shorter than ``MIN_WORDS`` words are dropped, so the text is mostly prose. Files are read in sorted name order and paragraphs in document order, so the
token stream, and therefore every window offset, is deterministic.
"""
from __future__ import annotations

import glob
import os
from functools import lru_cache
from html.parser import HTMLParser
from typing import List, Optional

CORPUS_DIR = "/usr/share/debian-reference"
CORPUS_PACKAGE = "debian-reference-en"
INSTALL_HINT = f"sudo apt-get install {CORPUS_PACKAGE}"
# a paragraph with more than this fraction of its (non-blank) characters inside <code> is a command listing
MAX_CODE_FRACTION = 0.5
MIN_WORDS = 4


class CorpusMissing(RuntimeError):
    """The Debian Reference HTML is not installed."""


_BLOCK_TAGS = frozenset({"p", "li", "dd", "dt", "td", "th", "h1", "h2", "h3", "h4", "h5", "caption"})
_CODE_TAGS = frozenset({"code", "tt", "literal", "kbd", "samp"})
_SKIP_TAGS = frozenset({"pre", "script", "style", "head"})


class _ParagraphParser(HTMLParser):
    """Collects the text of each block element (paragraphs, list items, table cells, headings).

    Flat: a block's text ends where the next block opens or the block closes, so a ``<p>``
    nested inside an ``<li>`` is its own block. ``<pre>`` is skipped, and a block whose
    characters sit mostly inside ``<code>`` is dropped (a command, not prose).
    """

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: List[str] = []
        self._in_block = False
        self._depth_code = 0
        self._depth_skip = 0
        self._buf: List[str] = []
        self._code_chars = 0

    def handle_starttag(self, tag, attrs):
        if tag in _BLOCK_TAGS:
            self._finish()
            self._in_block = True
        elif tag in _CODE_TAGS:
            self._depth_code += 1
        elif tag in _SKIP_TAGS:
            self._depth_skip += 1
        elif tag == "br":
            self._buf.append(" ")

    def handle_endtag(self, tag):
        if tag in _BLOCK_TAGS:
            self._finish()
        elif tag in _CODE_TAGS and self._depth_code:
            self._depth_code -= 1
        elif tag in _SKIP_TAGS and self._depth_skip:
            self._depth_skip -= 1

    def handle_data(self, data):
        if self._in_block and not self._depth_skip:
            self._buf.append(data)
            if self._depth_code:
                self._code_chars += len("".join(data.split()))

    def close(self):
        super().close()
        self._finish()

    def _finish(self):
        text = " ".join("".join(self._buf).split())
        code = self._code_chars
        self._buf, self._code_chars, self._in_block = [], 0, False
        if len(text.split()) < MIN_WORDS:
            return
        if code > MAX_CODE_FRACTION * len("".join(text.split())):
            return
        self.paragraphs.append(text)


def corpus_files(corpus_dir: str = CORPUS_DIR) -> List[str]:
    """The manual's chapter files in sorted order (the table-of-contents page is skipped)."""
    files = sorted(glob.glob(os.path.join(corpus_dir, "*.en.html")))
    files = [f for f in files if not os.path.basename(f).startswith("index.")]
    if not files:
        raise CorpusMissing(
            f"evaluation corpus not found (no *.en.html under {corpus_dir}); install it with: {INSTALL_HINT}"
        )
    return files


def html_paragraphs(html: str) -> List[str]:
    """Prose paragraphs of one HTML document, whitespace-normalized, in document order."""
    parser = _ParagraphParser()
    parser.feed(html)
    parser.close()
    return parser.paragraphs


@lru_cache(maxsize=4)
def corpus_text(corpus_dir: str = CORPUS_DIR) -> str:
    """All kept paragraphs of the manual, separated by blank lines."""
    paragraphs: List[str] = []
    for path in corpus_files(corpus_dir):
        with open(path, encoding="utf-8", errors="replace") as f:
            paragraphs.extend(html_paragraphs(f.read()))
    return "\n\n".join(paragraphs)


def corpus_tokens(tokenizer, corpus_dir: str = CORPUS_DIR, min_tokens: Optional[int] = None) -> List[int]:
    """Token ids of :func:`corpus_text` (no special tokens). ``min_tokens`` raises if fewer."""
    ids = list(tokenizer.encode(corpus_text(corpus_dir), add_special_tokens=False))
    if min_tokens is not None and len(ids) < min_tokens:
        raise ValueError(
            f"corpus has {len(ids)} tokens, fewer than min_tokens={min_tokens}"
        )
    return ids
