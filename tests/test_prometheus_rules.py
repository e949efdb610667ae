"""Prometheus scrape config, alert rules and the Grafana dashboard: promtool checks and metric names."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULES = PROMETHEUS_DIR / "rules" / "qwen38.rules.yml"
RULES_TEST = PROMETHEUS_DIR / "rules" / "qwen38.rules.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "qwen38-gateway.json"
GRAFANA_PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
JOB = "qwen38-gateway"

# The contract's series (DESIGN section 7 and the engine series appended to the same scrape):
# name -> (type, labels). Histograms are read as NAME_bucket (plus ``le``), NAME_sum, NAME_count.
_VLLM = ("model_name", "engine", "vllm_engine")
CONTRACT_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gateway_requests_total": ("counter", ("tenant", "route", "code")),
    "gateway_request_duration_seconds": ("histogram", ("tenant", "route")),
    "gateway_time_to_first_token_seconds": ("histogram", ("tenant",)),
    "gateway_tokens_total": ("counter", ("tenant", "type")),
    "gateway_requests_in_flight": ("gauge", ("tenant",)),
    "gateway_queue_depth": ("gauge", ()),
    "gateway_body_memory_bytes": ("gauge", ()),
    "gateway_queue_wait_seconds": ("histogram", ("tenant",)),
    "gateway_rate_limited_total": ("counter", ("tenant", "limit")),
    "gateway_auth_failures_total": ("counter", ("reason",)),
    "gateway_client_disconnects_total": ("counter", ("tenant",)),
    "gateway_upstream_errors_total": ("counter", ("kind",)),
    "gateway_engine_up": ("gauge", ()),
    "gateway_engine_ready": ("gauge", ()),
    "gateway_keys_loaded": ("gauge", ()),
    "gateway_config_reloads_total": ("counter", ("result",)),
    "gateway_engine_scrape_ok": ("gauge", ()),
    "gateway_ratelimit_backend_up": ("gauge", ("backend",)),
    "gateway_ledger_records_total": ("counter", ()),
    "gateway_ledger_write_errors_total": ("counter", ()),
    "gateway_ledger_dropped_records_total": ("counter", ()),
    "gateway_ledger_pending_records": ("gauge", ()),
    "gateway_ledger_shipped_records_total": ("counter", ()),
    "gateway_ledger_unshipped_records": ("gauge", ()),
    "gateway_fleet_redis_up": ("gauge", ()),
    "gateway_engine_lease_held": ("gauge", ("engine",)),
    "gateway_quota_limit_tokens": ("gauge", ("tenant", "window")),
    "gateway_quota_used_tokens": ("gauge", ("tenant", "window")),
    "gateway_quarantined_requests_total": ("counter", ("tenant",)),
    "gateway_quarantine_entries": ("gauge", ()),
    "gateway_engine_retries_total": ("counter", ()),
    "gateway_prompt_counts_total": ("counter", ()),
    "gateway_prompt_ceiling_exceeded_total": ("counter", ()),
    # The wait prediction behind deadline refusals (gateway/deadline.py).
    "gateway_deadline_refusals_total": ("counter", ("tenant", "dialect", "reason")),
    "gateway_queue_start_forecast_error_seconds": ("histogram", ("direction",)),
    "gateway_forecast_tokens_per_second": ("gauge", ("phase",)),
    "gateway_forecast_output_tokens": ("gauge", ("thinking",)),
    # One series per configured engine (gateway/fleet.py); ``engine`` is the [[engines]] name.
    "gateway_engine_status": ("gauge", ("engine",)),
    "gateway_engine_slots": ("gauge", ("engine",)),
    "gateway_engine_in_flight": ("gauge", ("engine",)),
    "gateway_engine_in_rotation": ("gauge", ("engine",)),
    "gateway_engine_requests_total": ("counter", ("engine",)),
    "gateway_engine_failovers_total": ("counter", ("engine",)),
    "vllm:num_requests_running": ("gauge", _VLLM),
    "vllm:num_requests_waiting": ("gauge", _VLLM),
    "vllm:kv_cache_usage_perc": ("gauge", _VLLM),
    "vllm:prompt_tokens_total": ("counter", _VLLM),
    "vllm:generation_tokens_total": ("counter", _VLLM),
    "vllm:request_success_total": ("counter", (*_VLLM, "finished_reason")),
    "vllm:time_to_first_token_seconds": ("histogram", _VLLM),
    "vllm:e2e_request_latency_seconds": ("histogram", _VLLM),
    # From the launcher's status file (gateway/launcher_status.py).
    # Each engine's file, labelled with its engine.
    "qwen38_engine_restarts_total": ("counter", ("engine", "reason")),
    "qwen38_engine_hangs_total": ("counter", ("engine",)),
    "qwen38_engine_stalled_seconds": ("gauge", ("engine",)),
    "qwen38_engine_launcher_state": ("gauge", ("engine", "state")),
}
# Labels Prometheus attaches to every series of the scrape target.
TARGET_LABELS = frozenset({"job", "instance"})
# Synthesised by Prometheus for every target, not exported by the gateway.
PROMETHEUS_SERIES = frozenset({"up"})
# Grafana variables and the values that make an expression plain PromQL for promtool.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$instance": ".*",
    "$tenant": ".*",
    "$engine": ".*",
}
PROMQL_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "inf",
        "nan",
    }
)
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING_RE = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.IGNORECASE
)
_IDENT_RE = re.compile(r"(?<![\w:.])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])(\s*\()?")


def promql_series_names(expr: str) -> set[str]:
    """Series names an expression selects, as written (``x_bucket`` stays ``x_bucket``).

    Strings, label matchers (``{...}``), range and subquery brackets, grouping clauses
    (``by (...)``, ``on (...)`` ...), function names (an identifier before ``(``), keywords and
    numbers are not names. Enough for the expressions of dashboards and rules; not a full parser.
    """
    text = _STRING_RE.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING_RE.sub(" ", text)
    names = set()
    for match in _IDENT_RE.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


_MATCHER_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUP_LABELS_RE = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", re.IGNORECASE
)


def promql_label_names(expr: str) -> set[str]:
    """Label names an expression matches on (``{name=...}``) or groups by (``by (...)`` etc.)."""
    text = _STRING_RE.sub('""', expr)
    labels: set[str] = set()
    for block in re.findall(r"\{([^}]*)\}", text):
        labels |= set(_MATCHER_RE.findall(block))
    for group in _GROUP_LABELS_RE.findall(text):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    return labels


def labels_of(series_name: str) -> set[str]:
    """The labels a contract series carries besides the target's (``le`` on ``_bucket``)."""
    family = family_of(series_name)
    if family in PROMETHEUS_SERIES:
        return set()
    kind, labels = CONTRACT_METRICS[family]
    if kind == "histogram" and series_name.endswith("_bucket"):
        return {*labels, "le"}
    return set(labels)


def family_of(series_name: str) -> str:
    """The contract family a series name belongs to (``x_bucket`` -> ``x`` for histograms)."""
    for suffix in _HISTOGRAM_SUFFIXES:
        base = series_name.removesuffix(suffix)
        if base != series_name and CONTRACT_METRICS.get(base, ("",))[0] == "histogram":
            return base
    return series_name


def substitute_grafana_variables(expr: str) -> str:
    """Replace the dashboard's template variables by values promtool accepts."""
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(variable, GRAFANA_VARIABLES[variable])
    return expr


def load_dashboard() -> dict[str, Any]:
    """The dashboard JSON as a dict."""
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every panel target of the dashboard, variables left in."""
    return [
        (panel["title"], target["expr"])
        for panel in _panels(load_dashboard()["panels"])
        for target in panel.get("targets", [])
    ]


def rule_expressions() -> list[tuple[str, str]]:
    """(alert or record name, PromQL) for every rule of qwen38.rules.yml."""
    document = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [
        (rule.get("alert") or rule["record"], rule["expr"])
        for group in document["groups"]
        for rule in group["rules"]
    ]


def used_series_names(*, include_prometheus: bool = False) -> set[str]:
    """Every series name the dashboard and the alert rules read, as it appears in a scrape.

    A live scrape of the gateway (with its engine) should expose each of these; ``up`` is made
    by Prometheus and is left out unless ``include_prometheus``.
    """
    names: set[str] = set()
    for _, expr in [*dashboard_expressions(), *rule_expressions()]:
        names |= promql_series_names(substitute_grafana_variables(expr))
    if not include_prometheus:
        names -= PROMETHEUS_SERIES
    return names


def used_metric_families() -> set[str]:
    """The contract families behind `used_series_names` (histogram suffixes removed)."""
    return {family_of(name) for name in used_series_names()}


def alert_names() -> set[str]:
    """Names of the alerting rules."""
    document = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return {
        rule["alert"] for group in document["groups"] for rule in group["rules"] if "alert" in rule
    }


def promtool() -> str:
    """Path of promtool; skips the test when it is not installed (Debian package prometheus)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return path


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run promtool with a time bound and captured text output."""
    return subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def test_metric_name_extraction_ignores_labels_functions_and_grouping() -> None:
    """The name parser returns selected series only, not labels, functions, keywords or durations."""
    expr = (
        "histogram_quantile(0.95, sum by (tenant, le) (rate(gateway_queue_wait_seconds_bucket"
        '{tenant=~"a|b", route="/v1/x"}[5m]))) > on (instance) group_left gateway_engine_up'
        ' and ignoring(code) vllm:kv_cache_usage_perc offset 5m or absent(up{job="x"}) * 2'
    )
    assert promql_series_names(expr) == {
        "gateway_queue_wait_seconds_bucket",
        "gateway_engine_up",
        "vllm:kv_cache_usage_perc",
        "up",
    }
    assert promql_series_names('sum(rate(not_a_contract_metric{code="5.."}[1m]))') == {
        "not_a_contract_metric"
    }


def test_family_of_maps_histogram_series_only() -> None:
    """Histogram series map to their family; a counter's _count-like name is left alone."""
    assert family_of("gateway_time_to_first_token_seconds_bucket") == (
        "gateway_time_to_first_token_seconds"
    )
    assert family_of("vllm:e2e_request_latency_seconds_count") == "vllm:e2e_request_latency_seconds"
    assert family_of("gateway_requests_total") == "gateway_requests_total"
    assert family_of("gateway_tokens_total_count") == "gateway_tokens_total_count"


def test_prometheus_config_passes_promtool_check_config() -> None:
    """deploy/prometheus/prometheus.yml and the rule file it names pass promtool check config."""
    result = run_promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert result.returncode == 0, result.stdout + result.stderr


def test_scrape_config_targets_the_gateway_metrics_listener() -> None:
    """The scrape job is qwen38-gateway on 127.0.0.1:9400 /metrics and loads the alert rules."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text(encoding="utf-8"))
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == JOB]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert [t for sc in job["static_configs"] for t in sc["targets"]] == ["127.0.0.1:9400"]
    rule_files = [PROMETHEUS_CONFIG.parent / name for name in config["rule_files"]]
    assert RULES in rule_files


def test_alert_rules_pass_promtool_check_rules() -> None:
    """qwen38.rules.yml passes promtool check rules."""
    result = run_promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    """qwen38.rules.test.yml passes promtool test rules (each alert fires and stays quiet)."""
    result = run_promtool("test", "rules", RULES_TEST.name, cwd=RULES_TEST.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_cover_the_contracted_failures() -> None:
    """There is an alert for every failure issue 6 lists, and each has severity and summary."""
    required = {
        "Qwen38GatewayDown",
        "Qwen38EngineDown",
        "Qwen38EngineNotReady",
        "Qwen38High5xxRatio",
        "Qwen38SlowTimeToFirstToken",
        "Qwen38QueueBacklog",
        "Qwen38QueueShedding",
        "Qwen38TenantThrottled",
        "Qwen38KeysReloadFailing",
        "Qwen38EngineScrapeFailing",
        "Qwen38KVCacheNearlyFull",
    }
    assert required <= alert_names()
    document = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    for group in document["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
            assert rule["annotations"]["summary"], rule["alert"]


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    """Each alert appears in the promtool tests both with expected alerts and with none."""
    document = yaml.safe_load(RULES_TEST.read_text(encoding="utf-8"))
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in document["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert firing == alert_names()
    assert quiet == alert_names()


def test_dashboard_parses_with_a_prometheus_datasource_variable() -> None:
    """The dashboard is JSON with a Prometheus datasource variable that every panel uses."""
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in _panels(dashboard["panels"]) if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]


def test_dashboard_layout_is_consistent() -> None:
    """Panel ids are unique and every panel fits the 24-column grid."""
    panels = list(_panels(load_dashboard()["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]


def test_dashboard_expressions_parse_with_promtool(tmp_path: Path) -> None:
    """Every panel expression, variables substituted, is valid PromQL for promtool check rules."""
    rules = []
    for number, (title, expr) in enumerate(dashboard_expressions()):
        plain = substitute_grafana_variables(expr)
        assert "$" not in plain, f"{title}: unknown variable in {expr}"
        rules.append({"record": f"qwen38:dashboard_check:{number}", "expr": plain})
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rejects_a_broken_expression(tmp_path: Path) -> None:
    """The expression check above can fail: promtool rejects malformed PromQL."""
    path = tmp_path / "broken.rules.yml"
    rule = {"record": "qwen38:broken", "expr": "sum(rate(gateway_requests_total[5m])"}
    path.write_text(yaml.safe_dump({"groups": [{"name": "broken", "rules": [rule]}]}))
    assert run_promtool("check", "rules", str(path)).returncode != 0


def test_dashboard_and_rules_name_only_contracted_metrics() -> None:
    """Every series read by the dashboard or the rules belongs to the contract's metric list."""
    names = used_series_names()
    assert {name for name in names if family_of(name) not in CONTRACT_METRICS} == set()
    bare_histograms = {
        name for name in names if CONTRACT_METRICS.get(name, ("",))[0] == "histogram"
    }
    assert bare_histograms == set(), "read a histogram's _bucket, _sum or _count series"


def test_dashboard_shows_the_contracted_views() -> None:
    """The dashboard reads requests, latency, TTFT, tokens, queue, limits, engine load, KV and up."""
    names = {
        name
        for _, expr in dashboard_expressions()
        for name in promql_series_names(substitute_grafana_variables(expr))
    }
    assert {
        "gateway_requests_total",
        "gateway_request_duration_seconds_bucket",
        "gateway_time_to_first_token_seconds_bucket",
        "gateway_tokens_total",
        "gateway_queue_depth",
        "gateway_queue_wait_seconds_bucket",
        "gateway_rate_limited_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "gateway_engine_up",
    } <= names


def test_dashboard_repeats_a_row_per_engine_filtered_by_its_name() -> None:
    """Several engines: an ``engine`` variable drawn from the gateway's engine series (all
    selectable), a row repeated for each, and every panel of it filtered by ``$engine``, showing
    readiness, in-flight against slots, requests and failovers."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    engine = variables["engine"]
    assert "label_values(gateway_engine_status" in engine["definition"]
    assert engine["multi"] and engine["includeAll"]
    panels = dashboard["panels"]
    rows = [i for i, p in enumerate(panels) if p.get("type") == "row" and p.get("repeat")]
    assert [panels[i]["repeat"] for i in rows] == ["engine"]
    start = rows[0] + 1
    end = next((i for i in range(start, len(panels)) if panels[i].get("type") == "row"), None)
    inside = panels[start:end]
    assert inside
    for panel in inside:  # the queue depth may stand beside an engine's own series
        assert any('engine=~"$engine"' in t["expr"] for t in panel["targets"]), panel["title"]
    exprs = [t["expr"] for p in inside for t in p["targets"]]
    names = {n for e in exprs for n in promql_series_names(substitute_grafana_variables(e))}
    assert {
        "gateway_engine_status",
        "gateway_engine_in_flight",
        "gateway_engine_slots",
        "gateway_engine_requests_total",
        "gateway_engine_failovers_total",
    } <= names


def test_grafana_provisioning_points_at_the_installed_dashboard() -> None:
    """The provisioning files parse; the dashboard provider reads where install.sh puts the JSON."""
    datasources = yaml.safe_load((GRAFANA_PROVISIONING / "datasources" / "qwen38.yml").read_text())
    assert datasources["datasources"][0]["type"] == "prometheus"
    providers = yaml.safe_load((GRAFANA_PROVISIONING / "dashboards" / "qwen38.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/usr/local/share/qwen38/grafana"


def test_label_name_extraction_finds_matchers_and_grouping() -> None:
    """Matcher names and grouping labels are found; label values and metric names are not."""
    expr = (
        'sum by (tenant, le) (rate(x_bucket{route=~"/v1/.*", code!="200"}[5m])) '
        '/ on (instance) group_left max(y{job="qwen38-gateway"})'
    )
    assert promql_label_names(expr) == {"tenant", "le", "route", "code", "instance", "job"}


def test_dashboard_and_rules_use_only_labels_their_metrics_carry() -> None:
    """Each expression matches and groups only by labels of the series it reads (plus job, instance)."""
    for title, expr in [*dashboard_expressions(), *rule_expressions()]:
        plain = substitute_grafana_variables(expr)
        carried = set(TARGET_LABELS)
        for name in promql_series_names(plain):
            carried |= labels_of(name)
        assert promql_label_names(plain) <= carried, title


def test_gateway_exporter_declares_the_families_read_here() -> None:
    """The gateway's metric families include every gateway_* family read here, with its type."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.metrics import Metrics

    registry = CollectorRegistry()
    Metrics(registry)
    exposition = generate_latest(registry).decode()
    declared = dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE))
    for family in sorted(used_metric_families()):
        if family.startswith("gateway_"):
            assert declared.get(family) == CONTRACT_METRICS[family][0], family
