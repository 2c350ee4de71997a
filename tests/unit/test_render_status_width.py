"""The status table's width and units: at 120 columns nothing wraps, GPU names are short,
units are in the headers and one unit (MiB) is used throughout, TEMP and POWER with --wide."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.core.model import HostResult, parse_snapshot
from gpufleet.render.common import short_gpu_name
from gpufleet.render.status import status_headers, status_table

FIX = Path(__file__).resolve().parent.parent / "fixtures"
BLACKWELL = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def blackwell_node() -> HostResult:
    """A realistic 8-GPU host (scenarios/train-node.json, built from recorded output: two vLLM
    DP replicas with their EngineCores, a torchrun job with a long command line, GPU clients)
    under a long host name, on GPUs with the longest model name NVIDIA ships."""
    doc = json.loads((FIX / "scenarios" / "train-node.json").read_text())
    for gpu in doc["gpus"]:
        gpu["name"] = BLACKWELL
    return HostResult(host="blackwell-node-01", ok=True, snapshot=parse_snapshot(doc))


def test_at_120_columns_nothing_wraps_and_nothing_is_lost_but_tails() -> None:
    res = blackwell_node()
    snap = res.snapshot
    assert snap is not None and len(snap.gpus) == 8 and snap.compute_apps
    text = status_table([res], {}, width=120)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120, "\n".join(ln for ln in lines if len(ln) > 120)
    assert " clients " in text  # the GPU clients' row is there
    for app in snap.compute_apps:  # every holder: its PID, user and memory on a line
        assert f"{app.pid} alice {app.used_mib}MiB" in text, app.pid
    assert "train.py --config" in text and "VLLM::Worker_DP1_TP1" in text
    whole = status_table([res], {})  # to a pipe: nothing cut, one line per holder
    assert max(len(line) for line in whole.splitlines()) > 120
    assert "4520 alice 38912MiB train.py --config configs/llama3-8b.yaml" in whole


@pytest.mark.parametrize("width", [120, 132, 160])
def test_every_line_fits_any_terminal_the_columns_leave_room_on(width: int) -> None:
    text = status_table([blackwell_node()], {}, width=width)
    assert max(len(line) for line in text.splitlines()) <= width


@pytest.mark.parametrize("name,short", [
    ("NVIDIA H200", "NVIDIA H200"),
    ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
    (BLACKWELL, "RTX PRO 6000"),
    ("NVIDIA GeForce RTX 5090", "GeForce RTX 5090"),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", "RTX 4090 Laptop"),
    ("NVIDIA H100 80GB HBM3", "H100 80GB HBM3"),
    ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
    ("Tesla V100-SXM2-32GB", "V100-SXM2-32GB"),
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "RTX PRO 6000 ..."),
    ("NVIDIA\x1b[2J H200", "NVIDIA\\x1b[2J..."),  # a name is text from the host
])
def test_gpu_names_are_short_as_nvidia_smi_cuts_them(name: str, short: str) -> None:
    assert short_gpu_name(name) == short


def test_units_are_in_the_headers_and_memory_is_mib_throughout() -> None:
    res = HostResult(host="h200", ok=True, snapshot=parse_snapshot(
        json.loads((FIX / "status" / "basic.json").read_text())))
    text = status_table([res], {})
    header = text.splitlines()[0]
    assert "MEMORY (MiB)" in header and "UNATTR (MiB)" in header
    assert "26651 / 143771" in text and "GiB" not in text  # never 26.0GiB next to 5638MiB
    assert "425 root 20998MiB " in text and "426 root 5638MiB " in text


def test_wide_adds_temperature_and_power() -> None:
    res = HostResult(host="h200", ok=True, snapshot=parse_snapshot(
        json.loads((FIX / "status" / "basic.json").read_text())))  # the H200's NVML readings
    assert "TEMP (C)" not in status_table([res], {})
    wide = status_table([res], {}, wide=True)
    assert status_headers(True)[5:7] == ["TEMP (C)", "POWER (W)"]
    assert (first_row(wide)["TEMP (C)"], first_row(wide)["POWER (W)"]) == ("41", "82")
    na = HostResult(host="wsl", ok=True, snapshot=parse_snapshot(
        json.loads((FIX / "status" / "na_fields.json").read_text())))  # nvidia-smi: none
    row = first_row(status_table([na], {}, wide=True))
    assert (row["TEMP (C)"], row["POWER (W)"]) == ("n/a", "n/a")


def first_row(table: str) -> dict[str, str]:
    """The first row's cells by header, from the dashes line's spans."""
    header, dashes, row = table.splitlines()[:3]
    spans, start = [], None
    for pos, ch in enumerate(dashes + " "):
        if ch == "-" and start is None:
            start = pos
        elif ch != "-" and start is not None:
            spans.append((start, pos))
            start = None
    return {header[a:b].strip(): row[a:b].strip() for a, b in spans}


def test_short_of_room_health_puts_its_code_under_the_severity() -> None:
    """A long host name and a long finding code: HEALTH goes on two lines rather than the
    holders below their floor or a line past the terminal."""
    doc = json.loads((FIX / "scenarios" / "train-node.json").read_text())
    for gpu in doc["gpus"]:
        gpu.update(name=BLACKWELL, remapped_rows_failure=gpu["index"] == 1,
                   ecc_uncorrected_volatile=0, pcie_gen_current=5, pcie_gen_max=5,
                   clocks_event_reasons=0)
    res = HostResult(host="blackwell-node-01", ok=True, snapshot=parse_snapshot(doc))
    text = status_table([res], {}, width=120)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120
    at = next(i for i, line in enumerate(lines) if "CRITICAL" in line)
    assert "remap_failure" not in lines[at] and "remap_failure" in lines[at + 1]
    assert "CRITICAL remap_failure" in status_table([res], {})  # a pipe: one line


def test_a_host_findings_message_wraps_rather_than_being_cut() -> None:
    res = blackwell_node()
    text = status_table([res], {}, {"blackwell-node-01": 9}, width=120)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120
    at = next(i for i, line in enumerate(lines) if " host " in line)
    col = lines[at].index("8 GPU(s)")  # HOLDERS, the last column
    assert lines[at][col:] != "8 GPU(s) found, the inventory expects 9"  # it did not fit...
    found = " ".join(line[col:].strip() for line in lines[at:at + 2])
    assert found == "8 GPU(s) found, the inventory expects 9", lines[at:at + 2]  # ...all of it
