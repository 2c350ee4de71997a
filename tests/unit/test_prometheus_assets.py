"""The shipped Grafana dashboard and alert rules use only what gpufleet exports.

Both also run for real in tests/integration/test_prometheus_lab.py: promtool checks the rules,
a real Prometheus evaluates them and every dashboard query over the lab.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from gpufleet.core.metrics import COUNTER, FAMILIES, ExportOptions, _Families

ASSETS = Path(__file__).resolve().parents[2] / "docs" / "prometheus"
# PromQL's functions, aggregations and keywords that can appear as bare words in our queries
PROMQL_WORDS = {"sum", "count", "max", "min", "avg", "by", "on", "without", "ignoring", "unless",
                "and", "or", "time", "rate", "increase", "label_values", "group_left",
                "group_right", "topk", "bottomk", "absent", "changes", "humanize1024"}


def exported() -> dict[str, set[str]]:
    """Exported series names (counters with _total) -> their label names."""
    fam = _Families(ExportOptions(per_process=True))
    out = {}
    for name, (kind, _, _, _) in FAMILIES.items():
        labels = set(fam.labels_of(name))
        out[name] = labels
        if kind == COUNTER:
            assert name.endswith("_total")
    return out


def words(expr: str) -> tuple[set[str], set[str]]:
    """(metric-or-function words, label names in matchers and groupings) of a PromQL expr."""
    labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"", expr))
    for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {w.strip() for w in group.split(",") if w.strip()}
    bare = re.sub(r"\"[^\"]*\"", "", expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\b(?:by|on|without|ignoring)\s*\([^)]*\)", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", bare)), labels


def dashboard_queries() -> list[str]:
    dash = json.loads((ASSETS / "gpufleet-dashboard.json").read_text())
    out = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["query"]["query"])
    return out


def check(expr: str) -> None:
    known = exported()
    if expr.startswith("label_values("):  # Grafana's: label_values(METRIC, LABEL)
        metric, label = (w.strip() for w in expr[len("label_values("):].rstrip(")").split(","))
        expr, extra = metric, {label}
    else:
        extra = set()
    names, labels = words(expr)
    labels |= extra
    metrics = {w for w in names if w not in PROMQL_WORDS}
    assert metrics and metrics <= set(known), (expr, metrics - set(known))
    carried = set().union(*(known[m] for m in metrics))
    assert labels <= carried, (expr, labels - carried)


def test_dashboard_is_json_and_queries_only_exported_metrics() -> None:
    queries = dashboard_queries()
    assert len(queries) >= 10
    for expr in queries:
        check(expr)


def test_dashboard_legends_name_labels_the_series_have() -> None:
    dash = json.loads((ASSETS / "gpufleet-dashboard.json").read_text())
    known = exported()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            metrics = {w for w in words(target["expr"])[0] if w not in PROMQL_WORDS}
            carried = set().union(*(known[m] for m in metrics))
            used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            assert used <= carried, (target, used - carried)


def test_alert_rules_use_only_exported_metrics() -> None:
    doc = yaml.safe_load((ASSETS / "gpufleet-rules.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"GpufleetUnexpectedUnattributedMemory",
                                          "GpufleetUnlistedDeviceFileHolder", "GpufleetHostDown"}
    for rule in rules:
        check(rule["expr"])


def test_the_checker_catches_a_name_that_is_not_exported() -> None:
    import pytest

    with pytest.raises(AssertionError):
        check('sum(DCGM_FI_DEV_FB_USED{host="a"})')
    with pytest.raises(AssertionError):
        check('sum by (pod) (gpufleet_gpu_memory_used_bytes)')
