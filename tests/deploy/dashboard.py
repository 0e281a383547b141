"""The Grafana dashboard's PromQL against what the services expose: every metric name in every panel's queries
(and in the template variable's label_values) must be a sample name of a live /metrics, and every label a query
filters or groups on must be on that metric (or be one Prometheus adds at scrape time)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent.parent
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "pagedq.json"
# Added by Prometheus (job, instance) or by monitoring/prometheus.yml's relabelling (service).
SCRAPE_LABELS = frozenset({"job", "instance", "service"})
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or"})
KEYWORDS |= {"unless", "offset", "inf", "nan", "Inf", "NaN"}
IDENTIFIER = r"[A-Za-z_:][A-Za-z0-9_:]*"

Exposed = dict[str, set[str]]  # sample name -> the label names its samples carry


def exposed(*metrics_texts: str) -> Exposed:
    """Every sample name of these /metrics texts, with its label names."""
    found: Exposed = {}
    for text in metrics_texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                found.setdefault(sample.name, set()).update(sample.labels)
    return found


def queries(dashboard: dict) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' nested panels included."""
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, labels, strings and ranges left out)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    names = set()
    for match in re.finditer(IDENTIFIER, bare):
        if bare[match.end() :].lstrip().startswith("(") or match.group(0) in KEYWORDS:
            continue  # a function or an aggregation, or a keyword
        if match.start() and (bare[match.start() - 1].isdigit() or bare[match.start() - 1] == "."):
            continue  # the exponent or suffix of a number (1e3)
        names.add(match.group(0))
    return names


def label_uses(expr: str) -> tuple[list[tuple[str, str]], set[str]]:
    """([(metric, label) a selector matches on], the labels of by (...) / without (...) clauses)."""
    matched = [
        (metric, label)
        for metric, body in re.findall(rf"({IDENTIFIER})\s*\{{([^}}]*)\}}", expr)
        for label in re.findall(rf"({IDENTIFIER})\s*(?:=~|!~|!=|=)", re.sub(r'"(?:[^"\\]|\\.)*"', '""', body))
    ]
    grouped = {
        label.strip()
        for clause in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in clause.split(",")
        if label.strip()
    }
    return matched, grouped


def problems(dashboard: dict, found: Exposed) -> list[str]:
    """What the dashboard asks for that the scraped metrics do not have (empty: every query can be answered)."""
    out = []
    for title, expr in queries(dashboard):
        names = metric_names(expr)
        if not names:
            out.append(f"{title!r}: no metric name found in {expr!r}")
        for name in sorted(names - found.keys()):
            out.append(f"{title!r}: {name} is not on any scraped /metrics")
        matched, grouped = label_uses(expr)
        for metric, label in matched:
            if metric in found and label not in found[metric] | SCRAPE_LABELS:
                out.append(f"{title!r}: {metric} has no label {label!r}")
        have = set().union(*(found.get(n, set()) for n in names), SCRAPE_LABELS)
        out += [f"{title!r}: no metric of {expr!r} has label {label!r}" for label in sorted(grouped - have)]
    for variable in dashboard.get("templating", {}).get("list", []):
        pattern = rf"label_values\(\s*({IDENTIFIER})\s*,\s*({IDENTIFIER})\s*\)"
        for metric, label in re.findall(pattern, _query(variable)):
            if label not in found.get(metric, set()):
                out.append(f"variable {variable['name']!r}: no {metric} with label {label!r}")
    return out


def _query(variable: dict) -> str:
    query = variable.get("query", "")
    return query.get("query", "") if isinstance(query, dict) else str(query)


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def all_names(dashboard: dict) -> set[str]:
    return set().union(*(metric_names(expr) for _, expr in queries(dashboard)))
