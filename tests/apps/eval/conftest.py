"""Fixtures of the evaluation harness's tests (tests/apps/eval/)."""
from __future__ import annotations

import pytest

from veloxquant_mlx.apps.eval import corpus as corpus_mod


@pytest.fixture(scope="module")
def corpus_ids(smollm2):
    import os

    if not os.path.isdir(corpus_mod.CORPUS_DIR):
        pytest.skip(f"corpus missing: {corpus_mod.INSTALL_HINT}")
    return corpus_mod.corpus_tokens(smollm2[1])
