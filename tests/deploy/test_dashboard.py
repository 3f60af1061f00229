"""The Grafana dashboard, offline: the monitoring component ships it as a ConfigMap Grafana's sidecar loads, the JSON
is a well-formed dashboard, and every PromQL expression names only series, labels and functions that exist (here
against the metric registries of the code; tests/cluster/test_cluster_e2e.py checks it against a running cluster's scrape)."""

from __future__ import annotations

import json
from typing import Any

import prometheus_client
import pytest

from deploy.dashboard import TARGET_LABELS, dashboard, expressions
from deploy.manifests import K8S_DIR, render
from deploy.promql import exported_series, names, unknown_names
from router.metrics import RouterMetrics


def code_series() -> dict[str, set[str]]:
    from common.engine.io_struct import QueueLoad
    from common.node.metrics import observe_load  # registers the node metrics in the default registry

    # what a node's first load report sets (the queue gauges have no series before it)
    observe_load([QueueLoad(dp_rank=0, running=0, waiting=0, free_kv_pages=1, total_kv_pages=1, free_req_slots=1,
                            total_req_slots=1, token_usage=0.0)])
    text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode() + RouterMetrics().render().decode()
    return exported_series(text)


def shipped_dashboard() -> dict[str, Any]:
    maps = [d for d in render("prod") if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pdcluster-grafana-dashboard"]
    assert len(maps) == 1
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    (name, text), = maps[0]["data"].items()
    assert name.endswith(".json")
    return json.loads(text)


def test_configmap_carries_the_generated_dashboard() -> None:
    board = shipped_dashboard()
    assert board == json.loads(json.dumps(dashboard()))
    assert (K8S_DIR / "components" / "monitoring" / "dashboard.json").read_text().startswith("{")


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    variables = {v["name"] for v in board["templating"]["list"]}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"].strip("${}") in variables
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            for label in names(t["expr"]).labels:
                assert "$" not in label
            for var in (w.strip("${}") for w in t["expr"].split() if w.startswith("$") and "__" not in w):
                assert var in variables, (p["title"], var)
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for topic in ("request rate", "ttft", "itl", "end-to-end", "tokens/s", "queue depth per queue and role",
                  "kv usage", "kv bytes", "failures", "retries", "migrations", "circuit breaker", "per worker"):
        assert topic in titles, topic


def test_every_expression_names_exported_series() -> None:
    assert unknown_names(list(expressions(dashboard())), code_series(), TARGET_LABELS) == []


@pytest.mark.parametrize(("good", "bad"), [
    ("pdcluster_router_ttft_seconds_bucket", "pdcluster_router_tfft_seconds_bucket"),
    ("pdcluster_router_ttft_seconds_bucket", "pdcluster_router_ttft_seconds_total"),  # a histogram has no _total
    ("pdcluster_router_retries_total", "pdcluster_router_retries"),  # a counter is stored as _total
    ('queue=~"$q"', 'qeue=~"$q"'),
    ("histogram_quantile(", "histogram_quantil("),
])
def test_a_misspelled_name_is_caught(good: str, bad: str) -> None:
    board = dashboard()
    hits = [t for p in board["panels"] for t in p.get("targets", []) if good in t["expr"]]
    if not hits:  # the label case: put a matcher into one expression
        t = next(t for p in board["panels"] for t in p.get("targets", []) if "pdcluster_node_queue_requests{" in t["expr"])
        t["expr"] = t["expr"].replace("pdcluster_node_queue_requests{", "pdcluster_node_queue_requests{" + good + ",")
        hits = [t]
    hits[0]["expr"] = hits[0]["expr"].replace(good, bad, 1)
    problems = unknown_names(list(expressions(board)), code_series(), TARGET_LABELS)
    assert len(problems) == 1, problems


def test_names_parses_selectors_ranges_and_groupings() -> None:
    n = names('histogram_quantile(0.99, sum by (le, pod) (rate(a_bucket{x="1e3 {y}", z!~"b"}[5m]))) / on(pod) '
              'clamp_min(b_total offset 1h, 1) and c:rec')
    assert n.metrics == {"a_bucket", "b_total", "c:rec"}
    assert n.labels == {"le", "pod", "x", "z"}
    assert n.functions == {"histogram_quantile", "sum", "rate", "clamp_min"}
