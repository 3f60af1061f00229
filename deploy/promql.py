"""What a PromQL expression names: its series (metric names), label names and functions. Enough of the grammar for
the dashboard's own expressions (selectors, ranges, aggregations with ``by``/``without``, binary operators, Grafana
variables such as ``$__rate_interval``); used to check the dashboard against what the code exports."""

from __future__ import annotations

import re
from dataclasses import dataclass

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_RANGE = re.compile(r"\[[^\]]*\]|\boffset\s+-?[\w${}]+")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_VARIABLE = re.compile(r"\$\{?\w+\}?")
_NUMBER = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\s*\()?")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
FUNCTIONS = frozenset({
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev", "count_values",
    "rate", "irate", "increase", "delta", "deriv", "changes", "resets", "histogram_quantile", "clamp_min",
    "clamp_max", "abs", "ceil", "floor", "round", "vector", "scalar", "time", "label_replace", "absent",
    "avg_over_time", "max_over_time", "min_over_time", "sum_over_time", "last_over_time",
    "label_values",  # Grafana's templating query
})


@dataclass(frozen=True)
class Names:
    metrics: frozenset[str]
    labels: frozenset[str]  # in label matchers and in by/without/on/ignoring lists
    functions: frozenset[str]


def names(expr: str) -> Names:
    """Series, label and function names in ``expr``. A bare identifier that is neither a function call nor an
    operator keyword is a metric name (``x_bucket`` stays as written: a histogram's series carry the suffix)."""
    text = _STRING.sub('""', expr)
    text = _RANGE.sub("", text)
    labels: set[str] = set()
    for m in _GROUPING.finditer(text):
        labels |= {s.strip() for s in m.group(1).split(",") if s.strip()}
    text = _GROUPING.sub(" ", text)
    for m in _MATCHERS.finditer(text):
        labels |= set(_MATCHER_LABEL.findall(m.group(1)))
    text = _MATCHERS.sub(" ", text)
    text = _NUMBER.sub(" ", _VARIABLE.sub(" ", text))
    metrics: set[str] = set()
    functions: set[str] = set()
    for m in _IDENT.finditer(text):
        word = m.group(0).rstrip("( \t")
        if m.group(1):
            functions.add(word)
        elif word not in _KEYWORDS:
            metrics.add(word)
    if "label_values" in functions:  # label_values(metric, label): the second argument is a label
        call = re.search(r"label_values\s*\(([^,)]*)(?:,\s*([a-zA-Z_]\w*))?\)", _STRING.sub('""', expr))
        if call and call.group(2):
            metrics.discard(call.group(2))
            labels.add(call.group(2))
    return Names(frozenset(metrics), frozenset(labels), frozenset(functions))


def exported_series(exposition: str) -> dict[str, set[str]]:
    """Series names a Prometheus server stores from one scrape of the text format, each with its label names.

    Every family declared by a ``# TYPE`` line counts even before it has samples (a labelled counter nobody has
    incremented yet): counters as ``<name>_total``, histograms as ``_bucket``/``_sum``/``_count``, summaries as
    ``_sum``/``_count`` and the bare name, others under their name."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "summary": ("", "_sum", "_count")}
    out: dict[str, set[str]] = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            name = name.removesuffix("_total") if kind.strip() == "counter" else name  # some writers keep it
            for suffix in suffixes.get(kind.strip(), ("",)):
                out.setdefault(name + suffix, set())
        elif line and not line.startswith("#"):
            series = line.rsplit(" ", 1)[0]
            name, _, rest = series.partition("{")
            out.setdefault(name, set()).update(_MATCHER_LABEL.findall(_STRING.sub('""', rest)))
    return out


def unknown_names(exprs: list[tuple[str, str]], series: dict[str, set[str]], target_labels: frozenset[str]) -> list[str]:
    """Problems of ``(where, expr)`` pairs against ``exported_series`` output: a metric no scrape holds, a label that
    neither the code nor the scrape target sets, a function PromQL does not have, an expression naming no metric.
    Labels are checked only where every metric of the expression has samples (a family nobody has set yet shows
    no label names in a scrape)."""
    labels = set(target_labels).union(*series.values())
    problems = []
    for where, expr in exprs:
        n = names(expr)
        problems += [f"{where}: metric {m} is not exported" for m in sorted(n.metrics - series.keys())]
        if all(series.get(m) for m in n.metrics):
            problems += [f"{where}: label {lb} is on no series" for lb in sorted(n.labels - labels)]
        problems += [f"{where}: unknown function {f}" for f in sorted(n.functions - FUNCTIONS)]
        if not n.metrics:
            problems.append(f"{where}: names no metric: {expr}")
    return problems
