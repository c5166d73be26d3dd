"""The Helm chart, rendered through Helm's own engine (helm-python-sdk wraps Helm's Go
SDK: no helm binary, no cluster). Value sets: the defaults and every helm/alignedserve/ci/*-values.yaml
(chart-testing's convention), so a new file there is checked by every test here."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm  # helm-python-sdk, a [dev] dependency: Helm's Go SDK, no helm binary
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "alignedserve"
RELEASE, NAMESPACE = "demo", "serving"
KUBE_VERSION = "1.31.0"
TOOLS = REPO / ".venv" / "tools"


def value_sets() -> dict[str, dict[str, Any]]:
    sets: dict[str, dict[str, Any]] = {"defaults": {}}
    for path in sorted((CHART / "ci").glob("*-values.yaml")):
        sets[path.name.removesuffix("-values.yaml")] = yaml.safe_load(path.read_text()) or {}
    return sets


VALUE_SETS = value_sets()


@dataclass
class Rendered:
    """One value set's install: every manifest (NOTES.txt aside), by kind and name."""

    name: str
    values: dict[str, Any]
    manifests: list[dict[str, Any]]
    notes: str
    files: dict[str, str] = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [m for m in self.of_kind(kind) if m["metadata"]["name"] == name]
        assert found, f"{self.name}: no {kind} {name}"
        return found[0]

    def pod_specs(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(object name, pod spec) of every Deployment and Pod."""
        for m in self.manifests:
            if m["kind"] == "Deployment":
                yield m["metadata"]["name"], m["spec"]["template"]["spec"]
            elif m["kind"] == "Pod":
                yield m["metadata"]["name"], m["spec"]


def render(values: dict[str, Any], name: str = RELEASE) -> Rendered:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        files = chart.render(values, name=name, namespace=NAMESPACE, is_install=True)
    manifests = [
        doc
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]
    notes = next((text for path, text in files.items() if path.endswith("NOTES.txt")), "")
    return Rendered(name, values, manifests, notes, files)


def fullname(release: str = RELEASE) -> str:
    return f"{release}-alignedserve"


def tool(name: str) -> str | None:
    """A tool from this venv (the [dev] extra), `make deploy-tools` (.venv/tools) or PATH."""
    for candidate in (Path(sys.executable).parent / name, TOOLS / "bin" / name, TOOLS / name / "bin" / name):
        if candidate.exists():
            return str(candidate)
    return shutil.which(name)
