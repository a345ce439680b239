"""deploy/grafana/pd.json (issue 45): the dashboard is a Grafana dashboard model every panel of
which reads the `${DS_PROMETHEUS}` datasource, and every metric its queries name (panels and
template variables) is one a live pd-router, prefill worker and decode worker export: each query
is checked against the /metrics of the process its `instance` matcher points at ($router,
$prefill, $decode), sample names as exposed (a histogram's `_bucket`, `_sum`, `_count`), and the
labels it matches or groups by against the labels of those samples. The workers are simulated
(`--simulate`: no weights), started once for the module with the router in front of them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd.ports import free_port
from tests.e2e.processes import CLUSTER_TOKEN, start_workers, stop

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "pd.json")
SIMULATE = "llama-3.1-8b:h100:tp1"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SOURCES = ("router", "prefill", "decode")  # the template variables that scope the queries
PRIORITY_ROW = "Priority classes"
# The router's priority-class metrics (issue 45): every priority panel reads these.
PRIORITY_METRICS = {
    "pd_router_class_requests_total",
    "pd_router_class_queued",
    "pd_router_class_inflight",
}
OUTCOMES = {"admitted", "queued", "refused", "timed_out", "preempted"}
# Labels Prometheus adds at scrape time (not in the exposition).
TARGET_LABELS = {"instance", "job"}
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range", "__all"}

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^}]*)\})?")
MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")
LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([a-zA-Z_]\w*)\s*\)\s*$", re.S)


def load() -> dict[str, Any]:
    with open(DASHBOARD) as f:
        return json.load(f)


def panels(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(the row it sits under, panel) for every panel, rows included: a collapsed row holds its
    panels in its own `panels`, an expanded one is followed by them."""
    row = ""

    def walk(items: list[dict[str, Any]], row: str) -> Iterator[tuple[str, dict[str, Any]]]:
        for p in items:
            yield row, p
            yield from walk(p.get("panels", []), p.get("title", row))

    for p in dashboard["panels"]:
        if p["type"] == "row":
            row = p["title"]
        yield from walk([p], row)


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(row, what, expr) for every panel target and every query variable's query."""
    found = [
        (row, p["title"], t["expr"]) for row, p in panels(dashboard) for t in p.get("targets", [])
    ]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            found.append(("", f"variable ${v['name']}", q))
    return found


def parse(expr: str) -> tuple[list[tuple[str, dict[str, str]]], set[str]]:
    """The selectors of a PromQL expression, [(metric name, {label: matched value})], and the
    labels it groups by. Strings are set aside first (a regex in a matcher holds any character),
    then the label matchers, then function names (a name before `(`) and keywords dropped;
    `label_values(selector, label)` (a variable's query) groups by its label."""
    grouped: set[str] = set()
    m = LABEL_VALUES.match(expr)
    if m:
        expr, label = m.groups()
        grouped.add(label)
    strings: list[str] = []

    def keep(s: re.Match[str]) -> str:
        strings.append(s.group()[1:-1])
        return f'"{len(strings) - 1}"'

    masked = STRING.sub(keep, expr)
    for g in GROUPING.findall(masked):
        grouped |= {label.strip() for label in g.split(",") if label.strip()}
    masked = GROUPING.sub(" ", masked)
    masked = re.sub(r"\[[^\]]*\]", " ", masked)  # range selectors and subqueries: durations
    selectors = []
    for s in SELECTOR.finditer(masked):
        name, matchers = s.group(1), s.group(2)
        if name.lower() in PROMQL_WORDS or masked[s.end() :].lstrip().startswith("("):
            continue  # a keyword, or a function or aggregation before its arguments
        labels = {label: strings[int(value)] for label, _, value in MATCHER.findall(matchers or "")}
        selectors.append((name, labels))
    return selectors, grouped


def source(labels: dict[str, str]) -> str | None:
    """The process a selector reads: the template variable its `instance` matcher names."""
    names = {a or b for a, b in VARIABLE.findall(labels.get("instance", ""))}
    found = names & set(SOURCES)
    return found.pop() if len(found) == 1 else None


# ------------------------------------------------------------------ the dashboard's shape


def test_the_dashboard_is_a_dashboard_model() -> None:
    d = load()
    assert d["title"] and re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", d["uid"])
    assert d["schemaVersion"] >= 36 and isinstance(d["panels"], list) and d["panels"]
    ids = [p["id"] for _, p in panels(d)]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), ids
    assert [i for i in d["__inputs"] if i["name"] == "DS_PROMETHEUS"] == [
        {
            "name": "DS_PROMETHEUS",
            "label": "Prometheus",
            "description": d["__inputs"][0]["description"],
            "type": "datasource",
            "pluginId": "prometheus",
            "pluginName": "Prometheus",
        }
    ]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert set(SOURCES) <= set(variables)
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE, v["name"]


def test_every_panel_reads_the_datasource_variable_and_fits_the_grid() -> None:
    d = load()
    titles = set()
    for row, p in panels(d):
        assert p["title"] and {"x", "y", "w", "h"} <= set(p["gridPos"]), p
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert (row, p["title"]) not in titles, f"two panels titled {p['title']!r} in {row!r}"
        titles.add((row, p["title"]))
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t.get("datasource", DATASOURCE) == DATASOURCE, p["title"]
            assert t["expr"].strip(), p["title"]


def test_queries_use_only_defined_variables_and_name_their_process() -> None:
    d = load()
    defined = {v["name"] for v in d["templating"]["list"]} | BUILTIN_VARIABLES
    for _, what, expr in queries(d):
        used = {a or b for a, b in VARIABLE.findall(expr)}
        assert used <= defined, (what, used - defined)
        selectors, grouped = parse(expr)
        assert selectors, (what, expr)
        if "histogram_quantile" in expr:
            assert "le" in grouped, (what, expr)
        if what.startswith("variable"):
            continue
        for name, labels in selectors:  # every panel query says which process it reads
            assert source(labels) is not None, (what, name)


def test_the_priority_row_covers_every_outcome_and_both_gauges() -> None:
    d = load()
    names, outcomes = set(), set()
    for row, _, expr in queries(d):
        if row != PRIORITY_ROW:
            continue
        for name, labels in parse(expr)[0]:
            names.add(name)
            if "outcome" in labels:
                outcomes.add(labels["outcome"])
    assert names == PRIORITY_METRICS and outcomes == OUTCOMES


def test_the_parser_finds_metrics_not_functions_labels_or_durations() -> None:
    selectors, grouped = parse(
        'histogram_quantile(0.99, sum by (le, route) (rate(a_bucket{instance=~"$router", '
        'x!~"b{2}c"}[$__rate_interval] offset 5m))) / on (route) group_left sum(vllm:k_perc) '
        "without (pool) > bool 1e3"
    )
    assert selectors == [("a_bucket", {"instance": "$router", "x": "b{2}c"}), ("vllm:k_perc", {})]
    assert grouped == {"le", "route", "pool"}
    assert parse('label_values(m{pool="decode"}, worker)') == (
        [("m", {"pool": "decode"})],
        {"worker"},
    )


# ------------------------------------------------------------------ against live processes


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _complete(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps({"model": "default", **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        r.read()


Exported = dict[str, dict[str, set[str]]]  # process -> sample name -> its label names


def _exposition(text: str) -> dict[str, set[str]]:
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, set()).update(s.labels)
    return samples


@pytest.fixture(scope="module")
def exported() -> Iterator[Exported]:
    """A simulated prefill and decode worker and pd-router in front of them; two requests (one
    decode-local, one long enough to go through P and a KV transfer, streamed), then each
    process's /metrics."""
    started = start_workers(
        ("--role", "prefill", "--simulate", SIMULATE),
        ("--role", "decode", "--simulate", SIMULATE),
        timeout=60,
    )
    (prefill, p_url), (decode, d_url) = started
    port = free_port()
    err = tempfile.TemporaryFile()
    router = subprocess.Popen(
        [sys.executable, "-m", "pd.router.main", "--port", str(port)]
        + ["--prefill", p_url, "--decode", d_url],
        stdout=subprocess.DEVNULL,
        stderr=err,
        env={**os.environ, "PD_CLUSTER_TOKEN": CLUSTER_TOKEN},
    )
    r_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if router.poll() is not None:
                err.seek(0)
                raise AssertionError(f"pd-router exited: {err.read()[-2000:].decode()}")
            try:
                if _get(f"{r_url}/health", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "pd-router did not become healthy"
            time.sleep(0.1)
        _complete(r_url, {"prompt": "hi", "max_tokens": 4})
        _complete(r_url, {"prompt": "the quick brown fox " * 200, "max_tokens": 4, "stream": True})
        found = {}
        for name, url in (("router", r_url), ("prefill", p_url), ("decode", d_url)):
            status, body = _get(f"{url}/metrics")
            assert status == 200, (name, status)
            found[name] = _exposition(body.decode())
        assert "pd_router_requests_total" in found["router"]
        assert "pd_kv_transfer_seconds_bucket" in found["decode"]
        yield found
    finally:
        stop(router)
        err.close()
        for proc, _ in started:
            stop(proc)


def _unexported(exported: Exported, priority: bool) -> list[str]:
    """What the dashboard's queries (the priority row's, or all the others) name that the
    process they read does not export: metrics, then labels matched or grouped by."""
    missing = []
    for row, what, expr in queries(load()):
        if (row == PRIORITY_ROW) != priority:
            continue
        selectors, grouped = parse(expr)
        labels_there: set[str] = set(TARGET_LABELS)
        before = len(missing)
        for name, labels in selectors:
            where = source(labels)
            there = (
                exported[where]
                if where
                else {n: ls for s in exported.values() for n, ls in s.items()}
            )
            if name not in there:
                missing.append(f"{what}: {name} (not in {where or 'any'} /metrics)")
                continue
            labels_there |= there[name]
            for label in set(labels) - there[name] - TARGET_LABELS:
                missing.append(f"{what}: {name} has no label {label!r}")
        for label in grouped - labels_there if len(missing) == before else ():
            missing.append(f"{what}: grouped by {label!r}, which none of its metrics has")
    return missing


@pytest.mark.slow
def test_every_query_names_metrics_and_labels_the_router_and_workers_export(
    exported: Exported,
) -> None:
    missing = _unexported(exported, priority=False)
    assert not missing, "\n".join(missing)


@pytest.mark.slow
def test_the_priority_class_panels_read_what_the_router_exports(exported: Exported) -> None:
    """pd_router_class_requests_total{class,outcome}, pd_router_class_queued{class} and
    pd_router_class_inflight{class}: each needs a sample after the fixture's two requests."""
    missing = _unexported(exported, priority=True)
    assert not missing, "\n".join(missing)
