"""The Grafana dashboard and the Prometheus alert rules in deploy/.

The rules are checked and unit-tested by promtool, which comes from Debian's `prometheus`
package (`make test` installs it). The dashboard is checked for what Grafana needs to
import it as-is and for what an operator expects to find on it. Both may only refer to
metrics the server exposes: `referenced_metric_names()` collects every name they use.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from .promql import base_names, grafana_query_metric_names, metric_names, selectors

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pagedserve.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"

# What the server exposes, with vLLM V1 names. Counters are listed as exposed (`_total`);
# histograms by their name, exposed as `_bucket`, `_sum` and `_count`.
EXPOSED_GAUGES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
        "pagedserve:prefill_tokens_beside_decodes",
    }
)
EXPOSED_COUNTERS = frozenset(
    {
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "pagedserve:request_errors_total",
        "pagedserve:requests_rejected_total",
        "pagedserve:api_requests_total",
        "pagedserve:engine_cpu_seconds_total",
        "pagedserve:engine_cpu_wait_seconds_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    }
)
EXPOSED_HISTOGRAMS = frozenset(
    {
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:iteration_tokens_total",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    }
)
# Series that Prometheus itself writes for every target.
PROMETHEUS_SERIES = frozenset({"up"})

REQUIRED_PANELS = frozenset(
    {
        "Request rate",
        "Running and waiting requests",
        "KV cache usage",
        "Prefix cache hit rate",
        "Time to first token",
        "Inter-token latency",
        "End-to-end request latency",
        "Token throughput",
        "Preemptions",
        "Errors",
    }
)
LATENCY_PANELS = ("Time to first token", "Inter-token latency", "End-to-end request latency")
PROMTOOL_MISSING = (
    "promtool is not on PATH. `make test` installs it from Debian's `prometheus` package "
    "(apt-get install -y --no-install-recommends prometheus)."
)


def exposed_series() -> set[str]:
    """Every series name a query may select: gauges, counters and histogram series."""
    histogram_series = {h + s for h in EXPOSED_HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
    return set(EXPOSED_GAUGES | EXPOSED_COUNTERS | PROMETHEUS_SERIES) | histogram_series


@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@cache
def rules_file() -> dict[str, Any]:
    return yaml.safe_load(ALERTS.read_text())


def rules() -> list[dict[str, Any]]:
    return [rule for group in rules_file()["groups"] for rule in group["rules"]]


def panels(container: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel, rows included, also those nested in collapsed rows."""
    for panel in (container or dashboard()).get("panels", []):
        yield panel
        yield from panels(panel)


def query_panels() -> list[dict[str, Any]]:
    return [p for p in panels() if p["type"] != "row"]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every panel target."""
    return [(p["title"], t.get("expr", "")) for p in query_panels() for t in p.get("targets", [])]


def variable_query(variable: dict[str, Any]) -> str:
    query = variable.get("query", "")
    return query.get("query", "") if isinstance(query, dict) else query


def referenced_metric_names() -> set[str]:
    """Every metric name the dashboard and the alert rules select, exactly as written.

    Histogram series keep their suffix (`..._bucket`); `promql.base_names` maps them back.
    """
    names: set[str] = set()
    for _, expr in dashboard_exprs():
        names |= metric_names(expr)
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            names |= grafana_query_metric_names(variable_query(variable))
    for rule in rules():
        names |= metric_names(rule["expr"])
    return names


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail(PROMTOOL_MISSING)
    return subprocess.run(
        [exe, *args], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )


# --- alert rules ---------------------------------------------------------------------


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_promtool_rule_unit_tests() -> None:
    result = promtool("test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    checks = [check for test in tests for check in test.get("alert_rule_test", [])]
    fired = {c["alertname"] for c in checks if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in checks if not c.get("exp_alerts")}
    alerts = {rule["alert"] for rule in rules()}
    assert alerts - fired == set(), "alerts never shown to fire"
    assert alerts - quiet == set(), "alerts never shown to stay quiet"


def test_every_alert_has_severity_annotations_and_for() -> None:
    names = [rule.get("alert") for rule in rules()]
    assert len(names) == len(set(names)), "duplicate alert names"
    for rule in rules():
        name = rule.get("alert")
        assert name, f"not an alerting rule: {rule}"
        assert rule.get("labels", {}).get("severity") in ("warning", "critical"), name
        annotations = rule.get("annotations", {})
        assert annotations.get("summary") and annotations.get("description"), name
        assert re.fullmatch(r"[1-9]\d*[smh]", str(rule.get("for", ""))), f"{name}: for"


def up_job_regexes() -> list[str]:
    found = []
    for rule in rules():
        for sel in selectors(rule["expr"]):
            job = sel.matcher("job")
            if sel.name == "up" and job is not None:
                assert job.op == "=~", f"{rule['alert']}: expected a regex job matcher"
                found.append(job.value)
    return found


@pytest.mark.parametrize(
    ("job", "matches"),
    [
        ("pagedserve", True),  # ServiceMonitor with jobLabel app.kubernetes.io/name
        ("llm-pagedserve", True),  # Service "<release>-pagedserve" from the chart
        ("llm/pagedserve", True),  # PodMonitor: "<namespace>/<name>"
        ("node-exporter", False),
        ("kube-state-metrics", False),
    ],
)
def test_target_down_selects_pagedserve_jobs(job: str, matches: bool) -> None:
    regexes = up_job_regexes()
    assert len(regexes) >= 2, "expected the target-down and all-targets-down rules"
    for regex in regexes:  # Prometheus anchors regex matchers at both ends
        assert bool(re.fullmatch(regex, job)) is matches, regex


# --- dashboard -----------------------------------------------------------------------


def datasource_refs(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            else:
                yield from datasource_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from datasource_refs(item)


def test_dashboard_is_importable_as_is() -> None:
    dash = dashboard()
    assert dash["title"] == "pagedserve"
    assert dash["uid"] == "pagedserve"
    assert dash.get("id") is None, "an exported id would clash on import"
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query"
    assert variable_query(model) == "label_values(vllm:num_requests_running, model_name)"
    refs = list(datasource_refs(dash))
    assert refs, "no panel names a data source"
    for ref in refs:
        assert ref == {"type": "prometheus", "uid": "${datasource}"}, ref


def test_dashboard_has_required_panels() -> None:
    titles = [p["title"] for p in query_panels()]
    assert REQUIRED_PANELS - set(titles) == set()
    assert len(titles) == len(set(titles)), "duplicate panel titles"


def test_every_panel_has_a_query() -> None:
    for panel in query_panels():
        targets = panel.get("targets", [])
        assert targets, panel["title"]
        for target in targets:
            assert target.get("expr", "").strip(), panel["title"]
        ref_ids = [t.get("refId") for t in targets]
        assert len(set(ref_ids)) == len(ref_ids), f"{panel['title']}: refIds {ref_ids}"


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    all_panels = list(panels())
    ids = [p["id"] for p in all_panels]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in all_panels:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                other = cells.setdefault((x, y), panel["title"])
                assert other == panel["title"], f"{panel['title']} overlaps {other}"


def test_every_dashboard_query_filters_on_model_name() -> None:
    for title, expr in dashboard_exprs():
        found = selectors(expr)
        assert found, f"{title}: no selector in {expr}"
        for sel in found:
            m = sel.matcher("model_name")
            assert m is not None and (m.op, m.value) == ("=~", "$model_name"), f"{title}: {expr}"


def test_latency_panels_show_p50_p90_p99() -> None:
    for title in LATENCY_PANELS:
        exprs = [expr for t, expr in dashboard_exprs() if t == title]
        quantiles = {q for e in exprs for q in re.findall(r"histogram_quantile\(\s*([\d.]+)", e)}
        assert quantiles == {"0.5", "0.9", "0.99"}, title
        for expr in exprs:
            assert all(s.name and s.name.endswith("_bucket") for s in selectors(expr)), expr


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    # Grafana fills these in before the query reaches Prometheus.
    grafana_ranges = re.compile(r"\$\{?__(rate_interval|interval|range)\}?")
    rules_for_promtool = [
        {"record": f"dashboard:query_{i}", "expr": grafana_ranges.sub("5m", expr)}
        for i, (_, expr) in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard_queries.yaml"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules_for_promtool}]})
    )
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# --- metric names --------------------------------------------------------------------


def test_referenced_metrics_are_exposed() -> None:
    names = referenced_metric_names()
    assert "vllm:num_requests_waiting" in names and "up" in names, "rules or dashboard unread"
    assert names - exposed_series() == set()


def test_dashboard_shows_every_exposed_metric() -> None:
    shown: set[str] = set()
    for _, expr in dashboard_exprs():
        shown |= metric_names(expr)
    server_metrics = EXPOSED_GAUGES | EXPOSED_COUNTERS | EXPOSED_HISTOGRAMS
    assert server_metrics - base_names(shown, EXPOSED_HISTOGRAMS) == set()
