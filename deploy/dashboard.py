"""The fleet's Grafana dashboard, written by ``python -m deploy.gen_k8s`` to
``deploy/k8s/components/monitoring/dashboard.json`` (the monitoring component turns it into a ConfigMap labelled
``grafana_dashboard: "1"`` for Grafana's dashboard sidecar).

Series come from the router (``pdcluster_router_*``, router/metrics.py) and the nodes (``pdcluster_node_*``,
common/node/metrics.py). The ServiceMonitors copy each pod's ``pdcluster.io/role`` label onto its series as
``pdcluster_io_role`` and Prometheus adds ``pod``: per-role panels group by the first, per-worker panels by the
second (router-side per-worker series carry the worker's address as ``worker``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

UID = "pdcluster-fleet"
ROLE = "pdcluster_io_role"
RI = "$__rate_interval"
# Labels a scrape target gets from Prometheus and the ServiceMonitors, beside those the code exports.
TARGET_LABELS = frozenset({"pod", "namespace", "instance", "job", "service", "endpoint", "container", ROLE})
_DS = {"type": "prometheus", "uid": "${datasource}"}
_NODE = f'{ROLE}=~"$role"'


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    mappings: tuple[tuple[int, str, str], ...] = ()  # (value, text, colour) for state panels


def _quantiles(metric: str, by: str = "") -> tuple[tuple[str, str], ...]:
    group = f"le, {by}" if by else "le"
    legend = f"p{{q}} {{{{{by}}}}}" if by else "p{q}"
    return tuple((f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket[{RI}])))",
                  legend.format(q=round(q * 100))) for q in (0.5, 0.9, 0.99))


def _rate(metric: str, by: str, selector: str = "") -> str:
    sel = f"{{{selector}}}" if selector else ""
    return f"sum by ({by}) (rate({metric}{sel}[{RI}]))"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Requests (router)", (
        Panel("Request rate by API and outcome",
              ((_rate("pdcluster_router_requests_total", "api, outcome"), "{{api}} {{outcome}}"),), "reqps"),
        Panel("TTFT", _quantiles("pdcluster_router_ttft_seconds"), "s",
              description="Arrival at the router to the first token"),
        Panel("ITL", _quantiles("pdcluster_router_itl_seconds"), "s",
              description="Gap between token chunks from the decode leg"),
        Panel("End-to-end latency", _quantiles("pdcluster_router_e2e_seconds"), "s"),
        Panel("Tokens/s", (
            (f"sum(rate(pdcluster_router_prompt_tokens_total[{RI}]))", "prompt"),
            (f"sum(rate(pdcluster_router_completion_tokens_total[{RI}]))", "generated"),
            (f"sum(rate(pdcluster_router_cached_tokens_total[{RI}]))", "prompt, from a prefix cache"),
        ), "short"),
        Panel("Prefix cache hit ratio", (
            (f"sum(rate(pdcluster_router_cached_tokens_total[{RI}])) / "
             f"clamp_min(sum(rate(pdcluster_router_prompt_tokens_total[{RI}])), 1)", "cached / prompt tokens"),
        ), "percentunit"),
        Panel("In flight per router and per worker", (
            ("sum by (pod) (pdcluster_router_inflight_requests)", "router {{pod}}"),
            ("sum by (worker) (pdcluster_router_worker_inflight_requests)", "{{worker}}"),
        )),
        Panel("Dispatches per worker",
              ((_rate("pdcluster_router_dispatches_total", "worker, role"), "{{worker}} ({{role}})"),),
              "reqps"),
    )),
    ("Queues and KV cache (nodes)", (
        Panel("Queue depth per queue and role",
              ((f"sum by ({ROLE}, queue) (pdcluster_node_queue_requests{{{_NODE}}})", f"{{{{{ROLE}}}}} {{{{queue}}}}"),)),
        Panel("Queue depth per worker",
              ((f"sum by (pod, queue) (pdcluster_node_queue_requests{{{_NODE}}})", "{{pod}} {{queue}}"),)),
        Panel("KV usage per worker",
              ((f"max by (pod, {ROLE}) (pdcluster_node_token_usage_ratio{{{_NODE}}})", "{{pod}}"),), "percentunit"),
        Panel("Free KV pages per worker",
              ((f"sum by (pod, {ROLE}) (pdcluster_node_free_kv_pages{{{_NODE}}})", "{{pod}}"),)),
        Panel("Node TTFT p99 per role", (
            (f"histogram_quantile(0.99, sum by (le, {ROLE}) (rate(pdcluster_node_ttft_seconds_bucket[{RI}])))",
             f"{{{{{ROLE}}}}}"),), "s"),
        Panel("Prefill queue time", _quantiles("pdcluster_node_queue_seconds", "pod"), "s",
              description="Time a request waits for a prefill batch"),
        Panel("Decode TPOT", _quantiles("pdcluster_node_tpot_seconds"), "s"),
        Panel("Node ITL", _quantiles("pdcluster_node_itl_seconds"), "s"),
    )),
    ("KV transfer", (
        Panel("KV bytes moved per second per worker",
              ((_rate("pdcluster_node_kv_transfer_bytes_sum", f"pod, {ROLE}", _NODE), "{{pod}}"),), "Bps"),
        Panel("Per-request transfer bandwidth",
              _quantiles("pdcluster_node_kv_transfer_bandwidth_bytes_per_second", ROLE), "Bps"),
        Panel("Transfer latency", _quantiles("pdcluster_node_kv_transfer_seconds", ROLE), "s"),
        Panel("Transfer and bootstrap failures",
              ((_rate("pdcluster_node_failures_total", f"pod, {ROLE}, kind, code"), "{{pod}} {{kind}} {{code}}"),),
              "reqps"),
    )),
    ("Reliability", (
        Panel("Retries by failed leg",
              ((_rate("pdcluster_router_retries_total", "leg"), "{{leg}}"),), "reqps"),
        Panel("Migrations by failed leg",
              ((_rate("pdcluster_router_migrations_total", "leg"), "{{leg}}"),), "reqps",
              description="Requests moved to another worker after producing tokens"),
        Panel("Aborts sent by role", ((_rate("pdcluster_router_aborts_total", "role"), "{{role}}"),), "reqps"),
        Panel("Node outcomes per role",
              ((_rate("pdcluster_node_requests_total", f"{ROLE}, outcome"), f"{{{{{ROLE}}}}} {{{{outcome}}}}"),),
              "reqps"),
        Panel("Circuit breaker per worker",
              (("max by (worker) (pdcluster_router_worker_circuit_state)", "{{worker}}"),), kind="state-timeline",
              mappings=((0, "closed", "green"), (1, "half-open", "yellow"), (2, "open", "red"))),
        Panel("Worker health per worker and role",
              (("min by (worker, role) (pdcluster_router_worker_healthy)", "{{role}} {{worker}}"),),
              kind="state-timeline", mappings=((0, "unhealthy", "red"), (1, "healthy", "green"))),
        Panel("Workers rejected by role and reason",
              ((_rate("pdcluster_router_worker_rejections_total", "role, reason"), "{{role}} {{reason}}"),),
              "reqps"),
    )),
)


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": p.unit}
    if p.mappings:
        defaults["mappings"] = [{"type": "value", "options": {str(v): {"text": t, "color": c, "index": i}
                                                              for i, (v, t, c) in enumerate(p.mappings)}}]
    return {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": _DS,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": _DS, "expr": e, "legendFormat": legend}
                    for i, (e, legend) in enumerate(p.targets)],
    }


def _panels() -> Iterator[dict[str, Any]]:
    pid, y = 1, 0
    for title, panels in ROWS:
        yield {"id": pid, "type": "row", "title": title, "collapsed": False,
               "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []}
        pid, y = pid + 1, y + 1
        for i, p in enumerate(panels):
            yield _panel(p, pid, 12 * (i % 2), y + 8 * (i // 2))
            pid += 1
        y += 8 * ((len(panels) + 1) // 2)


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID, "title": "pdcluster fleet", "tags": ["pdcluster"], "editable": True, "schemaVersion": 39,
        "description": "Generated by `python -m deploy.gen_k8s` from deploy/dashboard.py; do not edit.",
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "timezone": "utc",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "role", "type": "query", "label": "Node role", "datasource": _DS, "multi": True,
             "includeAll": True, "allValue": ".*", "refresh": 2, "current": {"text": "All", "value": "$__all"},
             "query": {"query": f"label_values(pdcluster_node_queue_requests, {ROLE})", "refId": "role"},
             "definition": f"label_values(pdcluster_node_queue_requests, {ROLE})"},
        ]},
        "annotations": {"list": []},
        "panels": list(_panels()),
    }


def expressions(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and templating query of a dashboard JSON."""
    for p in board["panels"]:
        for t in p.get("targets", []):
            yield p["title"], t["expr"]
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            yield f"variable {v['name']}", q["query"] if isinstance(q, dict) else q
