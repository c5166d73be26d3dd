"""JSON schemas of the custom resources the chart renders, for the fields it uses (written from the
Prometheus Operator's monitoring.coreos.com/v1 CRDs and KEDA's keda.sh/v1alpha1 ScaledObject CRD).

Kubernetes' own schemas (kubernetes-validate) do not cover CRDs. These check every field the chart sets:
names, nesting and types, with `additionalProperties: false` wherever the chart writes, so a misspelt
or misplaced field fails here as the API server would refuse it.
"""

from __future__ import annotations

from typing import Any

DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "minLength": 1}, "labels": LABELS, "annotations": LABELS},
}


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": METADATA,
            "spec": spec,
        },
    }


SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector", "endpoints"],
        "properties": {
            "selector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"matchLabels": LABELS, "matchExpressions": {"type": "array"}},
            },
            "namespaceSelector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                },
            },
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"},
                        "path": {"type": "string"},
                        "interval": DURATION,
                        "scrapeTimeout": DURATION,
                        "scheme": {"enum": ["http", "https"]},
                        "honorLabels": {"type": "boolean"},
                    },
                },
            },
        },
    },
)

PROMETHEUS_RULE = _resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "groups": {
                "type": "array",
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "rules"],
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "interval": DURATION,
                        "rules": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["expr"],
                                "properties": {
                                    "alert": {"type": "string"},
                                    "record": {"type": "string"},
                                    "expr": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                                    "for": DURATION,
                                    "keep_firing_for": DURATION,
                                    "labels": LABELS,
                                    "annotations": LABELS,
                                },
                            },
                        },
                    },
                },
            }
        },
    },
)

SCALED_OBJECT = _resource(
    "keda.sh/v1alpha1",
    "ScaledObject",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["scaleTargetRef", "triggers"],
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {
                    "name": {"type": "string"},
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "envSourceContainerName": {"type": "string"},
                },
            },
            "minReplicaCount": {"type": "integer", "minimum": 0},
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": {"type": "integer", "minimum": 1},
            "cooldownPeriod": {"type": "integer", "minimum": 0},
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["type", "metadata"],
                    "properties": {
                        "type": {"type": "string"},
                        "name": {"type": "string"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        "authenticationRef": {"type": "object"},
                    },
                },
            },
        },
    },
)

# the Prometheus scaler's metadata: these keys, strings, threshold a number
PROMETHEUS_TRIGGER_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["serverAddress", "query", "threshold"],
    "properties": {
        "serverAddress": {"type": "string", "pattern": "^https?://"},
        "query": {"type": "string", "minLength": 1},
        "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
        "activationThreshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
    },
}

SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE,
    ("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT,
}
