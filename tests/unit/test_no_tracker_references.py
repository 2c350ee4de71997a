"""The product and its tests say what and why, never "issue N": nobody outside has that
tracker, so a reader (an operator reading a metric's HELP, a contributor reading a test) is
left with a number that explains nothing."""
from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("gpufleet", "docs", "README.md", "CONTRIBUTING.md", "tests", "bench", "contrib", "playbooks")
TRACKER = re.compile(r"\bissues? [0-9]+|\(issue [0-9]+", re.IGNORECASE)
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".hypothesis", ".git"}


def _files() -> list[Path]:
    out: list[Path] = []
    for root in ROOTS:
        path = REPO_ROOT / root
        if path.is_file():
            out.append(path)
            continue
        for folder, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            out += [Path(folder) / n for n in names]
    return out


def test_no_text_cites_the_tracker() -> None:
    found = []
    for path in _files():
        data = path.read_bytes()
        if b"\0" in data:  # binary, as grep -I skips it
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if TRACKER.search(line):
                found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()[:100]}")
    assert found == [], "\n".join(found)


def test_the_health_metric_help_says_what_it_counts() -> None:
    from gpufleet.core.metrics import FAMILIES

    help_text = FAMILIES["gpufleet_health_finding"][1]
    assert "issue" not in help_text.lower()
    assert "gpufleet health" in help_text
