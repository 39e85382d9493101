"""The digest of the compiled kernel's sources (veloxquant_mlx.attention._sources.source_hash): what it covers, that it
changes with any of them and with nothing else, and that the module built here carries the digest of these sources."""
from __future__ import annotations

import hashlib
import shutil

from veloxquant_mlx.attention import _sources, kernel


def _tree(root, files):
    root.mkdir()
    for name, text in files.items():
        (root / name).write_bytes(text)
    return root


def test_the_digest_covers_cmake_and_the_cpp_files_by_name_and_content(tmp_path):
    files = {"CMakeLists.txt": b"project(x)", "a.cpp": b"int a;", "b.h": b"#pragma once", "c.hpp": b"//"}
    digest = _sources.source_hash(_tree(tmp_path / "one", files))
    want = hashlib.sha256()
    for name in sorted(files):  # sorted by path, each as name \0 content \0
        want.update(name.encode() + b"\0" + files[name] + b"\0")
    assert digest == want.hexdigest()[:16]
    # other files do not count; a changed byte, a renamed file do
    assert _sources.source_hash(_tree(tmp_path / "two", {**files, "notes.txt": b"x", "a.o": b"\1"})) == digest
    assert _sources.source_hash(_tree(tmp_path / "three", {**files, "a.cpp": b"int b;"})) != digest
    renamed = {("z.cpp" if n == "a.cpp" else n): t for n, t in files.items()}
    assert _sources.source_hash(_tree(tmp_path / "four", renamed)) != digest


def test_no_sources_no_digest(tmp_path):
    assert _sources.source_hash(_tree(tmp_path / "empty", {"README.md": b"built elsewhere"})) is None
    assert _sources.source_hash(tmp_path / "absent") is None


def test_the_shipped_sources_hash_the_same_wherever_they_lie(tmp_path):
    copy = shutil.copytree(_sources.SOURCE_DIR, tmp_path / "csrc")
    assert _sources.source_hash() == _sources.source_hash(copy) is not None
    assert len(_sources.source_hash()) == 16 and int(_sources.source_hash(), 16) >= 0


def test_the_built_module_was_built_from_these_sources():
    assert kernel.compiled_module().built_from_sources == _sources.source_hash()
