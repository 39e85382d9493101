"""The digest of the compiled kernel's sources (standard library only: `build_kernel` loads this file by path, the
kernel's loader imports it). Compiled into the module, so that a module built from other sources (a checkout
updated since the build) is refused."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"


def source_hash(source_dir: Path = SOURCE_DIR) -> Optional[str]:
    """A digest of the kernel's sources (CMakeLists.txt and the C++ files): compiled into the module, so that a
    module built from other sources (a checkout updated since) is refused. None where the sources are absent."""
    files = sorted(p for p in source_dir.glob("*") if p.suffix in (".cpp", ".h", ".hpp") or p.name == "CMakeLists.txt")
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
