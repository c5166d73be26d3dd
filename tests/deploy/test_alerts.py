"""The alert rules the chart renders: `promtool check rules` passes, `promtool test rules` shows every
alert firing on a synthetic series and quiet on a healthy one, every expression (alerts, autoscalers,
dashboard) names only metrics the services export, every alert links a runbook that exists, every
runbook names only real metrics, and every exported metric is documented in docs/metrics.md.

promtool comes from `make deploy-tools` (Debian's prometheus package, unpacked); where it cannot be had,
the rules are parsed with promql-parser instead and the firing tests are skipped (saying so).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from chart_support import CHART, NAMESPACE, REPO, Rendered, fullname, tool
from exported_metrics import EXTERNAL, families, series_names

RUNBOOKS = REPO / "docs" / "runbooks"
FN = fullname()
GATEWAY = f'namespace="{NAMESPACE}",service="{FN}-gateway"'
SECTIONS = ("## Meaning", "## Impact", "## Diagnosis", "## Mitigation", "## Escalation")
# the procedures ops follow, beside the one page per alert
PROCEDURES = {
    "README", "install", "upgrade-rollback", "scaling", "drain-decode-node", "broker", "kv-pool-exhaustion",
    "gpu-xid", "ucx-transport", "slo-report",
}  # fmt: skip


@pytest.fixture(scope="module")
def rules(rendered: dict[str, Rendered]) -> list[dict[str, Any]]:
    (rule,) = rendered["redis-bus"].of_kind("PrometheusRule")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def alerts(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}


def metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def test_every_expression_names_only_exported_metrics(rendered: dict[str, Rendered], rules: list) -> None:
    known = series_names() | EXTERNAL
    exprs = {f"alert {name}": rule["expr"] for name, rule in alerts(rules).items()}
    for value_set, install in rendered.items():
        for scaled in install.of_kind("ScaledObject"):
            for trigger in scaled["spec"]["triggers"]:
                exprs[f"{value_set} ScaledObject {scaled['metadata']['name']}"] = trigger["metadata"]["query"]
    for title, expr in dashboard_exprs().items():
        exprs[f"dashboard {title}"] = expr
    unknown = {where: sorted(metric_names(expr) - known) for where, expr in exprs.items()}
    assert not {k: v for k, v in unknown.items() if v}
    assert len(exprs) > 20


def dashboard_exprs() -> dict[str, str]:
    """The dashboard's queries, with Grafana's variables given values so PromQL parses them."""
    board = json.loads((CHART / "dashboards" / "alignedserve.json").read_text())
    found = {}
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "5m").replace("$namespace", NAMESPACE)
            found[f"{panel['title']} / {target.get('legendFormat', '')}"] = expr.replace("$release", FN)
    return found


def test_every_alert_links_its_runbook(rules: list) -> None:
    for name, rule in alerts(rules).items():
        url = rule["annotations"]["runbook_url"]
        assert url.endswith(f"/{name}.md"), url
        runbook = RUNBOOKS / f"{name}.md"
        assert runbook.exists(), f"{name}: no {runbook.relative_to(REPO)}"
        text = runbook.read_text()
        for section in SECTIONS:
            assert section in text, f"{runbook.name} has no '{section}'"
        # its Diagnosis starts from what fired: the runbook names the series the alert's expression reads
        named = {family.removesuffix("_bucket") for family in metric_names(rule["expr"])}
        assert any(name in text for name in named), f"{runbook.name} names none of {sorted(named)}"
        assert {"severity", "summary", "description"} <= set(rule["labels"]) | set(rule["annotations"])
    assert set(alerts(rules)) == {
        "AlignedServeTTFTHigh", "AlignedServeTPOTHigh", "AlignedServeQueueDepthHigh", "AlignedServeKVPoolFull",
        "AlignedServeBusLagHigh", "AlignedServeWorkerRestarting", "AlignedServeKVTransferFailures",
    }  # fmt: skip


def test_every_runbook_names_only_real_metrics_and_links_only_real_files() -> None:
    known = series_names() | set(families()) | EXTERNAL  # a histogram may be named by its family
    names = re.compile(r"\b(alignedserve:[a-z0-9_]+|kube_[a-z0-9_]+)")
    links = re.compile(r"\]\((?!https?://|#)([^)#]+)")
    pages = sorted(RUNBOOKS.glob("*.md"))
    missing = PROCEDURES - {page.stem for page in pages}
    assert not missing, f"no runbook for the procedures {sorted(missing)}"
    for page in pages:
        text = page.read_text()
        unknown = sorted(set(names.findall(text)) - known)
        assert not unknown, f"{page.name} names metrics nobody exports: {unknown}"
        for target in links.findall(text):
            assert (page.parent / target).resolve().exists(), (
                f"{page.name} links {target}, which does not exist"
            )


def test_every_exported_metric_is_documented() -> None:
    reference = (REPO / "docs" / "metrics.md").read_text()
    missing = [
        name
        for name, (kind, _, _) in families().items()
        if f"`{name}" not in reference and f"`{name}_total" not in reference
    ]
    assert not missing, f"docs/metrics.md lacks {missing}"


# ---- promtool -------------------------------------------------------------------------------------------

PROMTOOL = tool("promtool")


def _write_rules(path: Path, groups: list[dict[str, Any]], annotations: bool = True) -> None:
    if not annotations:  # the firing tests compare labels; annotations carry templated values
        groups = [
            {**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
            for g in groups
        ]
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))


def test_promtool_check_rules(rules: list, tmp_path: Path) -> None:
    if PROMTOOL is None:
        for rule in alerts(rules).values():
            promql_parser.parse(rule["expr"])
        pytest.skip("promtool not found (make deploy-tools); the expressions parsed with promql-parser")
    path = tmp_path / "rules.yaml"
    _write_rules(path, rules)
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts(rules))} rules found" in result.stdout


def _histogram(name: str, labels: str, les: list[str], counts: list[int]) -> list[dict[str, str]]:
    """Cumulative buckets growing each minute by `counts` (one per bound, +Inf last)."""
    return [
        {"series": f'{name}{{{labels},le="{le}"}}', "values": f"0+{count}x40"}
        for le, count in zip(les, counts, strict=True)
    ]


def _case(
    alert: str, firing: list[dict[str, str]], healthy: list[dict[str, str]], labels: dict[str, str]
) -> list[dict]:
    def test(series: list[dict[str, str]], fires: bool) -> dict[str, Any]:
        return {
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {
                    "eval_time": "35m",
                    "alertname": alert,
                    "exp_alerts": [{"exp_labels": labels}] if fires else [],
                }
            ],
        }

    return [test(firing, True), test(healthy, False)]


def promtool_cases() -> list[dict[str, Any]]:
    def worker(component: str) -> str:
        return f'namespace="{NAMESPACE}",service="{FN}-{component}-metrics"'

    ttft, tpot = (
        "alignedserve:time_to_first_token_seconds_bucket",
        "alignedserve:time_per_output_token_seconds_bucket",
    )
    lag = "alignedserve:bus_consume_lag_seconds_bucket"
    gw_pod, decode_pod = f"{FN}-gateway-7d9f8b6c5d-x2x4z", f"{FN}-decode-7d9f8b6c5d-x2x4z"
    warning = {"severity": "warning"}
    return [
        # p99 TTFT: every request between 5 and 10 s (firing) / under 1 s (healthy)
        *_case("AlignedServeTTFTHigh", _histogram(ttft, GATEWAY, ["1", "5", "10", "+Inf"], [0, 0, 10, 10]),
               _histogram(ttft, GATEWAY, ["1", "5", "10", "+Inf"], [10, 10, 10, 10]), warning),
        *_case("AlignedServeTPOTHigh", _histogram(tpot, GATEWAY, ["0.1", "0.5", "1", "+Inf"], [0, 0, 10, 10]),
               _histogram(tpot, GATEWAY, ["0.1", "0.5", "1", "+Inf"], [10, 10, 10, 10]), warning),
        *_case("AlignedServeQueueDepthHigh",
               [{"series": f'alignedserve:num_requests_waiting{{{GATEWAY},pod="{gw_pod}"}}', "values": "200+0x40"}],
               [{"series": f'alignedserve:num_requests_waiting{{{GATEWAY},pod="{gw_pod}"}}', "values": "10+0x40"}],
               {**warning, "pod": gw_pod}),
        *_case("AlignedServeKVPoolFull",
               [{"series": f'alignedserve:kv_pool_usage_perc{{{worker("kvpool")},pod="p"}}', "values": "0.99+0x40"}],
               [{"series": f'alignedserve:kv_pool_usage_perc{{{worker("kvpool")},pod="p"}}', "values": "0.5+0x40"}],
               {"severity": "critical", "pod": "p"}),
        *_case("AlignedServeBusLagHigh",
               _histogram(lag, f'{worker("prefill")},group="prefill"', ["0.5", "2", "5", "+Inf"], [0, 0, 20, 20]),
               _histogram(lag, f'{worker("prefill")},group="prefill"', ["0.5", "2", "5", "+Inf"], [20, 20, 20, 20]),
               {**warning, "group": "prefill"}),
        *_case("AlignedServeWorkerRestarting",
               [{"series": f'kube_pod_container_status_restarts_total{{namespace="{NAMESPACE}",pod="{decode_pod}",container="decode"}}',
                 "values": "0+1x40"}],
               [{"series": f'kube_pod_container_status_restarts_total{{namespace="{NAMESPACE}",pod="{decode_pod}",container="decode"}}',
                 "values": "3+0x40"}],
               {**warning, "namespace": NAMESPACE, "pod": decode_pod, "container": "decode"}),
        *_case("AlignedServeKVTransferFailures",
               [{"series": f'alignedserve:kv_transfer_failures_total{{{worker("decode")},pod="{decode_pod}"}}', "values": "0+1x40"}],
               [{"series": f'alignedserve:kv_transfer_failures_total{{{worker("decode")},pod="{decode_pod}"}}', "values": "0+0x40"}],
               {**warning, "pod": decode_pod}),
    ]  # fmt: skip


def test_promtool_test_rules_fires_each_alert_and_stays_quiet_when_healthy(
    rules: list, tmp_path: Path
) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool not found (make deploy-tools): the alerts' firing behaviour is not tested here")
    cases = promtool_cases()
    assert {c["alert_rule_test"][0]["alertname"] for c in cases} == set(alerts(rules))
    _write_rules(tmp_path / "rules.yaml", rules, annotations=False)
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": cases}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    result = subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
