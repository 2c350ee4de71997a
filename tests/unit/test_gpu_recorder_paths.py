"""The GPU recorder writes its own directories as words, and the committed real-GPU fixtures hold
no temp dir of the machine that recorded them (tests/gpu/portable.py)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_portable", REPO / "tests" / "gpu" / "portable.py")
assert _spec is not None and _spec.loader is not None
portable_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(portable_mod)


def test_a_recorded_document_names_its_directories_by_word(tmp_path: Path) -> None:
    out = tmp_path / "out"
    tmp = out / "gpufleet-gpu-v1k_0wvr"  # inside the out dir: the longer path wins
    tmp.mkdir(parents=True)
    doc = {"cmdline": "python3 %s/tests/gpu/gpu_holders.py --ready %s/ready-1.json" % (REPO, tmp),
           "log": str(out / "log.txt"), "venv": "/opt/torch/.venv/bin/python3"}
    path = tmp_path / "cli.json"
    portable_mod.write_json(path, doc, {"TMPDIR": tmp, "OUTDIR": out})
    assert json.loads(path.read_text()) == {
        "cmdline": "python3 REPO/tests/gpu/gpu_holders.py --ready TMPDIR/ready-1.json",
        "log": "OUTDIR/log.txt", "venv": "/opt/torch/.venv/bin/python3"}


def test_committed_gpu_fixtures_hold_no_recording_temp_dir() -> None:
    temp = re.compile(r"/tmp/(gpufleet-[a-z]+-|gout-|tmp)[A-Za-z0-9_]{6,}")
    found = sorted({"%s: %s" % (p.relative_to(REPO), m.group(0))
                    for p in (REPO / "tests" / "fixtures" / "real-h200").rglob("*") if p.is_file()
                    for m in temp.finditer(p.read_text(errors="replace"))})
    assert found == []
