"""Evaluation corpora, by name (``CORPORA``; ``--corpus NAME`` in the CLI and the benchmarks).

- ``debian-reference`` (the default): English prose paragraphs of the Debian Reference manual
  (``debian-reference-en``): technical documentation.
- ``kjv``: the narrative books of the King James Bible (Genesis 1 - Exodus 20, Joshua - 2 Samuel; public
  domain, Debian's ``bible-kjv``, printed by its ``bible`` program): 17th-century narrative prose, another
  domain, about 190k tokens. One paragraph per chapter, verse numbers and chapter headings dropped.

Both install offline from Debian (``scripts/setup.sh``); a missing one raises `CorpusMissing` naming the
package to install.

Debian Reference: the text of block elements (paragraphs, list items, table cells, headings) is extracted with
the stdlib ``html.parser``; ``<pre>`` code blocks are skipped and blocks that are mostly
``<code>`` or shorter than ``MIN_WORDS`` words are dropped, so the text is mostly prose. Files are read in sorted name order and paragraphs in document order, so the
token stream, and therefore every window offset, is deterministic.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from functools import lru_cache
from html.parser import HTMLParser
from typing import List, Optional, Sequence, Tuple

CORPUS_DIR = "/usr/share/debian-reference"
CORPUS_PACKAGE = "debian-reference-en"
INSTALL_HINT = f"sudo apt-get install {CORPUS_PACKAGE}"
# a paragraph with more than this fraction of its (non-blank) characters inside <code> is a command listing
MAX_CODE_FRACTION = 0.5
MIN_WORDS = 4


class CorpusMissing(RuntimeError):
    """An evaluation corpus is not installed (the message says how to install it)."""


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


def debian_reference_text(corpus_dir: str = CORPUS_DIR) -> str:
    """All kept paragraphs of the manual, separated by blank lines."""
    paragraphs: List[str] = []
    for path in corpus_files(corpus_dir):
        with open(path, encoding="utf-8", errors="replace") as f:
            paragraphs.extend(html_paragraphs(f.read()))
    return "\n\n".join(paragraphs)


# -- King James Bible, narrative books ----------------------------------------------------------------
KJV_PACKAGE = "bible-kjv"
KJV_PROGRAM = "bible"
# Narrative books only: the law codes of Exodus 21-40, Leviticus, Numbers and Deuteronomy are left out.
KJV_RANGES = ("gen1:1-exo20:26", "josh1:1-2sam24:25")
_VERSE = re.compile(r"^\s+\d+\s+(.*\S)\s*$")
_CHAPTER = re.compile(r"^\S.*\s\d+\s*$")


def kjv_paragraphs(listing: str) -> List[str]:
    """``bible -l`` output (chapter headings, then one numbered verse a line) -> one paragraph per chapter."""
    paragraphs: List[str] = []
    verses: List[str] = []
    for line in listing.splitlines():
        verse = _VERSE.match(line)
        if verse:
            verses.append(verse.group(1))
        elif _CHAPTER.match(line) and verses:
            paragraphs.append(" ".join(verses))
            verses = []
    if verses:
        paragraphs.append(" ".join(verses))
    return paragraphs


def kjv_text(program: str = KJV_PROGRAM) -> str:
    """The narrative books (``KJV_RANGES``), a chapter per paragraph, separated by blank lines."""
    path = shutil.which(program)
    if path is None:
        raise CorpusMissing(f"corpus 'kjv' not found (no {program!r} program); install it with: "
                            f"sudo apt-get install {KJV_PACKAGE}")
    # one verse a line: a line width wider than any verse
    out = subprocess.run([path, "-l10000", *KJV_RANGES], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "COLUMNS": "10000"})
    paragraphs = kjv_paragraphs(out.stdout)
    if out.returncode or not paragraphs:
        raise CorpusMissing(f"corpus 'kjv': {program!r} printed no verses (exit {out.returncode}: "
                            f"{out.stderr.strip()[:200]}); reinstall it with: sudo apt-get install --reinstall "
                            f"{KJV_PACKAGE} bible-kjv-text")
    return "\n\n".join(paragraphs)


# name -> text loader (no arguments); the first is the default
CORPORA = {"debian-reference": debian_reference_text, "kjv": kjv_text}
DEFAULT_CORPUS = "debian-reference"


def check_corpus(name: str) -> str:
    if not isinstance(name, str) or name not in CORPORA:
        raise ValueError(f"corpus must be one of {tuple(CORPORA)}, got {name!r}")
    return name


@lru_cache(maxsize=4)
def corpus_text(corpus: str = DEFAULT_CORPUS) -> str:
    """The text of the named corpus (``CORPORA``), paragraphs separated by blank lines."""
    return CORPORA[check_corpus(corpus)]()


def text_prefix(tokenizer) -> Tuple[int, ...]:
    """The ids the tokenizer puts before any text when it adds special tokens (its BOS: Gemma's ``<bos>``), ``()``
    when it adds none (SmolLM2's). Read from the tokenizer itself: ``encode`` with and without special tokens."""
    try:
        plain = list(tokenizer.encode("a", add_special_tokens=False))
        full = list(tokenizer.encode("a"))
    except TypeError:  # an encode without add_special_tokens adds none
        return ()
    for i in range(len(full) - len(plain) + 1):  # the text's ids inside what encode gives: what comes before
        if full[i : i + len(plain)] == plain:
            return tuple(int(t) for t in full[:i])
    return ()


class CorpusTokens(list):
    """A corpus's token ids (a list) and ``prefix``: what the tokenizer puts before a text (`text_prefix`: its BOS,
    or nothing), which every evaluation window starts with (`veloxquant_mlx.apps.eval.perplexity.window_tokens`, and the
    passkey prompts). A slice keeps the prefix."""

    def __init__(self, ids: Sequence[int] = (), prefix: Sequence[int] = ()):
        super().__init__(ids)
        self.prefix = tuple(int(t) for t in prefix)

    def __getitem__(self, item):
        out = super().__getitem__(item)
        return CorpusTokens(out, self.prefix) if isinstance(item, slice) else out


def tokenize_text(tokenizer, text: str) -> CorpusTokens:
    """``text``'s ids without special tokens, carrying the tokenizer's `text_prefix`."""
    return CorpusTokens(tokenizer.encode(text, add_special_tokens=False), text_prefix(tokenizer))


def corpus_tokens(tokenizer, corpus: str = DEFAULT_CORPUS, min_tokens: Optional[int] = None) -> CorpusTokens:
    """Token ids of :func:`corpus_text` (no special tokens; ``.prefix``: the tokenizer's BOS, if it adds one, which
    every evaluation window starts with). ``min_tokens`` raises if fewer."""
    ids = tokenize_text(tokenizer, corpus_text(corpus))
    if min_tokens is not None and len(ids) < min_tokens:
        raise ValueError(
            f"corpus {corpus!r} has {len(ids)} tokens, fewer than min_tokens={min_tokens}"
        )
    return ids
