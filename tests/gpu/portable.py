"""Recorded documents without the recording machine's own paths.

Fixtures are read on other machines and compared in diffs: a temp dir's random name
(``/tmp/gpufleet-gpu-v1k_0wvr``) or a checkout's location is noise there, so each is written
as a fixed word (TMPDIR, OUTDIR, REPO). Paths of the GPU machine's own software stay: facts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent


def portable(text: str, places: dict[str, Path]) -> str:
    """``text`` with each place's absolute path (and its resolved form) replaced by its word;
    longest first, so a temp dir inside the out dir keeps its own word."""
    pairs = {str(p): w for w, p in places.items()}
    pairs.update({str(Path(p).resolve()): w for w, p in places.items()})
    pairs.setdefault(str(REPO), "REPO")
    for path in sorted(pairs, key=len, reverse=True):
        if path not in ("", "/", "."):
            text = text.replace(path, pairs[path])
    return text


def write_json(path: Path, doc: Any, places: dict[str, Path], **dump: Any) -> None:
    """``doc`` as indented JSON at ``path``, with ``places`` made portable."""
    path.write_text(portable(json.dumps(doc, indent=1, **dump), places) + "\n")
