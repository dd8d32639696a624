"""Checks on the Grafana dashboard: every query names a metric the daemon exposes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.deploy._files import (
    DASHBOARD,
)

# Metric name -> its labels. Histograms also expose _bucket (with le), _sum and _count.
METRICS: dict[str, set[str]] = {
    "relayd_pool_capacity_bytes": {"pool"},
    "relayd_pool_used_bytes": {"pool"},
    "relayd_pool_largest_free_run_bytes": {"pool"},
    "relayd_leases": {"pool", "state"},
    "relayd_sessions": set(),
    "relayd_transfers_total": {"transport"},
    "relayd_transfer_bytes_total": {"transport"},
    "relayd_leases_reclaimed_total": {"reason"},
    "relayd_reserve_wait_seconds": set(),
    "relayd_mooncake_credits_in_use": {"peer"},
    "relayd_mooncake_credits_capacity": {"peer"},
    "relayd_peer_up": {"peer"},
    "relayd_peer_notice_channel": {"peer"},
    "relayd_peer_notice_channel_queued_bytes": {"peer"},
    "relayd_mooncake_pull_seconds": set(),
    "relayd_edge_transfers_total": {"from_stage", "to_stage", "transport"},
    "relayd_edge_bytes_total": {"from_stage", "to_stage", "transport"},
    "relayd_put_seconds": {"from_stage", "to_stage", "transport"},
    "relayd_get_seconds": {"from_stage", "to_stage", "transport"},
    "relayd_gc_pause_seconds": {"generation"},
}
HISTOGRAMS = {
    "relayd_reserve_wait_seconds",
    "relayd_mooncake_pull_seconds",
    "relayd_put_seconds",
    "relayd_get_seconds",
    "relayd_gc_pause_seconds",
}
TARGET_LABELS = {"instance", "job", "node", "pod", "namespace"}  # added by the scrape
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "and", "or", "unless",
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev",
    "rate", "irate", "increase", "delta", "histogram_quantile", "clamp_min", "clamp_max",
    "vector", "scalar", "abs", "max_over_time", "min_over_time", "avg_over_time",
    "changes", "resets", "time", "absent",
}  # fmt: skip


def _series_names() -> dict[str, set[str]]:
    names: dict[str, set[str]] = {}
    for name, labels in METRICS.items():
        if name in HISTOGRAMS:
            names[name + "_bucket"] = labels | {"le"}
            names[name + "_sum"] = set(labels)
            names[name + "_count"] = set(labels)
        else:
            names[name] = labels
    return names


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if var["type"] == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def _identifiers(expr: str) -> tuple[set[str], set[str]]:
    """(bare identifiers outside selectors and strings, label names used in groupings)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    grouped: set[str] = set()
    # Grafana's label_values(metric, label) in template variables.
    lv = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)\s*", text)
    if lv:
        text = lv.group(1)
        grouped.add(lv.group(2))
    for m in re.finditer(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        grouped |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\$\{?\w+\}?", " ", text)  # dashboard variables
    idents = set(re.findall(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)", text))
    return idents, grouped


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def test_dashboard_queries_use_only_known_metrics(dashboard: dict[str, Any]) -> None:
    series = _series_names()
    used: set[str] = set()
    exprs = _exprs(dashboard)
    assert exprs
    for expr in exprs:
        idents, grouped = _identifiers(expr)
        metrics = {i for i in idents if i not in PROMQL_WORDS}
        unknown = metrics - series.keys()
        assert not unknown, f"{expr}: unknown metric(s) {sorted(unknown)}"
        assert metrics, f"{expr}: references no relayd metric"
        labels = set().union(*(series[m] for m in metrics)) | TARGET_LABELS
        assert grouped <= labels, f"{expr}: grouping by {sorted(grouped - labels)}"
        used |= {m.removesuffix("_bucket") for m in metrics}
    missing = METRICS.keys() - used
    assert not missing, f"no panel shows {sorted(missing)}"


def test_dashboard_panels_and_datasource(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"].lower() for p in _panels(dashboard))
    for wanted in (
        "pool occupancy",
        "reserve wait p50 / p99",
        "transfers by transport",
        "bytes by transport",
        "credits",
        "reclaimed leases",
        "peers up",
        "throughput by edge",
        "put p99 by edge",
        "get p99 by edge",
        "arena and credit pressure",
    ):
        assert wanted in titles, wanted
    quantiles = [
        t["expr"]
        for p in _panels(dashboard)
        if "reserve wait" in p["title"].lower()
        for t in p["targets"]
    ]
    assert any(e.startswith("histogram_quantile(0.5,") for e in quantiles)
    assert any(e.startswith("histogram_quantile(0.99,") for e in quantiles)


def test_dashboard_per_edge_panels(dashboard: dict[str, Any]) -> None:
    """Throughput and p99 put/get per edge, with arena and credit pressure in the same row."""
    panels = {p["title"].lower(): p for p in _panels(dashboard)}

    def exprs(title: str) -> list[str]:
        return [t["expr"] for t in panels[title]["targets"]]

    assert any(
        "relayd_edge_bytes_total" in e and "by (from_stage, to_stage)" in e
        for e in exprs("throughput by edge")
    )
    for op in ("put", "get"):
        (e,) = exprs(f"{op} p99 by edge")
        assert e.startswith("histogram_quantile(0.99,"), e
        assert f"relayd_{op}_seconds_bucket" in e and "by (from_stage, to_stage, le)" in e, e
    pressure = " ".join(exprs("arena and credit pressure"))
    assert "relayd_pool_used_bytes" in pressure and "relayd_mooncake_credits_in_use" in pressure
    row_y = {panels[t]["gridPos"]["y"] for t in ("put p99 by edge", "get p99 by edge")}
    assert panels["arena and credit pressure"]["gridPos"]["y"] in row_y


def test_dashboard_metrics_are_what_the_daemon_exposes() -> None:
    """Every series the dashboard table names exists in a daemon's registry (no typos)."""
    from prometheus_client import CollectorRegistry

    from relayd.edges import EdgeStats
    from relayd.metrics import Metrics

    m = Metrics(CollectorRegistry())
    stats = EdgeStats()
    m.attach_edges(stats)
    m.attach_state(
        lambda: {
            "pools": [],
            "leases": {},
            "sessions": 0,
            "serving": 1,
        }
    )
    exposed = {fam.name for fam in m.registry.collect()}
    for name in METRICS:
        assert name.removesuffix("_total") in exposed, name
