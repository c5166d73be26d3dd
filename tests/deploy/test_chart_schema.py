"""values.schema.json: every key typed and bounded, unknown keys refused, and the message names the key
(as `helm install` and `helm template` print it: Helm validates values before rendering)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import values_reference
from chart_support import CHART, NAMESPACE, helm

SCHEMA = json.loads((CHART / "values.schema.json").read_text())


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"kvpool": {"poolBytes": "8Gi"}}, "/kvpool/poolBytes"),  # Kubernetes' unit: the service wants 8GiB
        ({"batcher": {"prefetch": True}}, "/batcher/prefetch"),  # YAML's `on`: a boolean, not "on"
        ({"batcher": {"replicas": 2}}, "/batcher/replicas"),  # a singleton
        ({"gateway": {"port": "8000"}}, "/gateway/port"),
        ({"gateway": {"prot": 8000}}, "'prot'"),
        ({"gpu": {"enabled": "yes"}}, "/gpu/enabled"),
        ({"decode": {"kvCacheBytes": "lots"}}, "/decode/kvCacheBytes"),
        ({"prefill": {"replicas": -1}}, "/prefill/replicas"),
        ({"ucx": {"transferPort": 70000}}, "/ucx/transferPort"),
        (
            {"monitoring": {"prometheusRule": {"slo": {"kvPoolUsage": 1.5}}}},
            "/monitoring/prometheusRule/slo/kvPoolUsage",
        ),
        ({"bus": {"type": "nats"}}, "/bus/type"),
        ({"bus": {"options": {"maxlen": "big"}}}, "/bus/options/maxlen"),
        ({"bus": {"options": {"max_len": 5}}}, "'max_len'"),
        ({"bus": {"deploy": False}}, "/bus/external/hosts"),  # an external broker needs its address
        ({"bus": {"type": "kafka"}}, "/bus/type"),  # the chart runs Redis only
        ({"model": {"source": "pvc"}}, "/model/pvc/claimName"),
        ({"image": {"digests": {"gateway": "latest"}}}, "/image/digests/gateway"),
        ({"logLevel": "verbose"}, "/logLevel"),
        ({"unknownTopLevel": 1}, "'unknownTopLevel'"),
    ],
)
def test_wrong_values_are_refused_naming_the_key(values: dict[str, Any], named: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError) as refused:
        chart.render(values, name="demo", namespace=NAMESPACE)
    assert named in str(refused.value), str(refused.value)


def _walk(node: dict[str, Any], path: str) -> list[str]:
    """Paths of object nodes that let unknown keys through (free-form Kubernetes objects aside)."""
    open_nodes = []
    if (
        node.get("type") == "object"
        and "properties" in node
        and node.get("additionalProperties") is not False
    ):
        open_nodes.append(path)
    for key, child in node.get("properties", {}).items():
        open_nodes += _walk(child, f"{path}.{key}")
    return open_nodes


def test_every_key_of_the_defaults_is_in_the_schema_and_every_object_is_closed() -> None:
    with helm.Chart.load(str(CHART)) as chart:
        defaults = chart.values

    def check(values: dict[str, Any], schema: dict[str, Any], path: str) -> None:
        props = schema.get("properties", {})
        for key, value in values.items():
            assert key in props or isinstance(schema.get("additionalProperties"), dict), (
                f"{path}.{key} not in schema"
            )
            child = props.get(key, schema.get("additionalProperties"))
            assert "type" in child or "anyOf" in child or "enum" in child, f"{path}.{key} has no type"
            if isinstance(value, dict) and "properties" in child:
                check(value, child, f"{path}.{key}")

    check(defaults, SCHEMA, "")
    assert _walk(SCHEMA, "") == []


def test_the_batcher_schema_says_why_it_is_a_singleton() -> None:
    replicas = SCHEMA["properties"]["batcher"]["properties"]["replicas"]
    assert replicas["maximum"] == 1 and "singleton" in replicas["description"]


def test_every_key_is_described_and_the_readme_reference_is_current() -> None:
    """helm/alignedserve/README.md documents every key (type, range, default, meaning) from the schema."""
    undescribed = [
        ".".join(path) for path, node in values_reference.leaves(SCHEMA) if not node.get("description")
    ]
    assert not undescribed, f"values.schema.json: describe {undescribed}"
    readme = (CHART / "README.md").read_text()
    assert values_reference.with_reference(readme) == readme, (
        "helm/alignedserve/README.md's values reference is stale: python tests/deploy/values_reference.py"
    )
    for path, _ in values_reference.leaves(SCHEMA):
        assert f"| `{'.'.join(path)}` |" in readme
