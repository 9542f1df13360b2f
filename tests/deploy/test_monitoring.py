"""The monitoring files of ``deploy/`` stay true to the service they watch.

* The alert rules and the example Prometheus configuration pass ``promtool check``, and the
  rules' unit tests (``loraledger-alerts.test.yml``: each rule fires on its case and stays
  quiet on a healthy run) pass ``promtool test rules`` (Debian's ``prometheus`` package;
  ./test.sh installs it; without it these tests fail under ``CI=true`` and skip elsewhere, as
  the PostgreSQL ones do).
* Every metric a dashboard panel, a dashboard variable or an alert rule names is exposed by a
  real ``loraledger serve`` process: a renamed or removed metric would otherwise leave a panel
  blank and an alert silently never firing (``absent()`` aside, PromQL finds nothing and says
  nothing). The names are read out of the PromQL expressions; a histogram or counter is named
  by its series (``_bucket``/``_sum``/``_count``, ``_total``).
* The dashboard is provisioning-ready: every query goes through the ``datasource`` variable,
  panel ids are unique, the grid fits 24 columns.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML: a requirement of transformers
from prometheus_client.parser import text_string_to_metric_families

from tests.support.paths import REPO
from tests.support.processes import listening_process

DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "loraledger-alerts.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
RULE_TESTS = DEPLOY / "prometheus" / "loraledger-alerts.test.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))

# --- metric names out of PromQL ---------------------------------------------------------------

_KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
     "offset", "bool", "inf", "nan", "atan2"}
)  # fmt: skip
_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKENS = re.compile(r"\$\{?\w+\}?|\d[\w.]*|[a-zA-Z_:][\w:]*(?:\s*\()?")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's ``$var`` and ``${var}`` and
    its ``label_values(metric, label)`` variable query understood). Label matchers, strings,
    ranges, grouping label lists, functions, keywords and numbers are not names."""
    found = _LABEL_VALUES.match(expr)
    if found:
        return {found.group(1)}
    text = _STRINGS.sub(" ", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers (strings are gone)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = _GROUPING.sub(" ", text)
    names = set()
    for token in _TOKENS.findall(text):
        if token.startswith("$") or token[0].isdigit() or token.endswith("("):
            continue  # a variable, a number or duration, a function or aggregation
        if token.lower() not in _KEYWORDS:
            names.add(token)
    return names


def test_metric_names_are_read_out_of_promql() -> None:
    """The reader the cross-check relies on: it finds what a query selects and nothing else."""
    assert metric_names(
        'histogram_quantile(0.95, sum by (le) (rate(a_bucket{instance=~"$instance", '
        'x="y(z)"}[$__rate_interval])))'
    ) == {"a_bucket"}
    assert metric_names(
        "changes(a[30m]) == 0 and on(instance) sum by (instance) (b) > 0.1 * c offset 5m"
    ) == {"a", "b", "c"}
    assert metric_names("sum(x) without (engine) / ignoring(code) group_left y") == {"x", "y"}
    assert metric_names("label_values(loraledger_last_seq, instance)") == {"loraledger_last_seq"}
    assert metric_names("absent(m) or vector(1e3)") == {"m"}


# --- what the files name ----------------------------------------------------------------------


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return panels


def _dashboard_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """Where -> PromQL, for every panel target and every query variable."""
    queries = {}
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            queries[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries[f"variable {variable['name']}"] = (
                query["query"] if isinstance(query, dict) else query
            )
    return queries


def named_metrics() -> dict[str, set[str]]:
    """Metric name -> where each is named (alert rules and dashboards)."""
    where: dict[str, set[str]] = {}
    queries = {f"alert {r['alert']}": r["expr"] for r in _rules()}
    for path in DASHBOARDS:
        for place, expr in _dashboard_queries(json.loads(path.read_text())).items():
            queries[f"{path.name}: {place}"] = expr
    for place, expr in queries.items():
        for name in metric_names(expr):
            where.setdefault(name, set()).add(place)
    return where


def exposed_series(exposition: str) -> set[str]:
    """Every series name a scrape can hold: the samples present, and for a family with none
    yet (a labelled counter before its first event) the names its type gives it."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
    }
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


# --- the checks -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_every_metric_the_dashboards_and_alerts_name_is_served(tmp_path: Path) -> None:
    """A real ``loraledger serve`` (loopback, port 0, a staleness bound so the bound's gauge
    is exposed) is scraped once; every name the monitoring files use must be in the scrape."""
    named = named_metrics()
    assert len(named) >= 15, sorted(named)  # the reader found the files' metrics at all
    args = ["serve", "--db", str(tmp_path / "ledger.db"), "--port", "0", "--max-staleness", "4",
            "--json"]  # fmt: skip
    async with listening_process(args) as (_, row), httpx.AsyncClient(timeout=30) as http:
        scrape = await http.get(f"{row['url']}/metrics")
    assert scrape.status_code == 200, scrape.text
    exposed = exposed_series(scrape.text)
    missing = {name: sorted(places) for name, places in named.items() if name not in exposed}
    assert not missing, f"named but not served by serve's /metrics: {missing}"


def test_a_name_serve_does_not_expose_is_caught() -> None:
    """The cross-check can fail: a histogram named without its series suffix, a counter
    without ``_total`` or an unknown gauge is not among the exposed series."""
    exposition = (
        "# TYPE a_seconds histogram\na_seconds_bucket{le=\"+Inf\"} 0\na_seconds_sum 0\n"
        "a_seconds_count 0\n# TYPE b counter\n# TYPE c gauge\nc 1\n"
    )  # fmt: skip
    exposed = exposed_series(exposition)
    assert {"a_seconds_bucket", "a_seconds_count", "b_total", "c"} <= exposed
    assert not {"a_seconds", "b", "d"} & exposed


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        why = "no promtool here: install Debian's prometheus package (./test.sh does)"
        if os.environ.get("CI"):
            pytest.fail(f"promtool is required in CI: {why}")
        pytest.skip(why)
    return found


@pytest.mark.parametrize(
    ("check", "path"),
    [
        (("check", "rules"), RULES),
        (("check", "config"), PROMETHEUS_CONFIG),
        (("test", "rules"), RULE_TESTS),  # each rule fires on its case, and not on a healthy run
    ],
    ids=["check-rules", "check-config", "test-rules"],
)
def test_promtool_accepts_the_prometheus_files(check: tuple[str, str], path: Path) -> None:
    result = subprocess.run(
        [_promtool(), *check, path.name],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_says_how_bad_and_what_to_do() -> None:
    rules = _rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.name for p in DASHBOARDS])
def test_the_dashboard_is_ready_to_provision(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] and dashboard["title"]
    assert "id" not in dashboard or dashboard["id"] is None  # Grafana assigns it
    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variable = {"type": "prometheus", "uid": "${datasource}"}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        assert panel["datasource"] == variable, panel["title"]
        assert all(t.get("datasource", variable) == variable for t in panel["targets"])
    assert DASHBOARDS, "no dashboard in deploy/grafana/dashboards"
