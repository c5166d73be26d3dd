"""The contract between the chart and the services: every container the chart renders, in every value
set, has its command, args and environment parsed by that service's real configuration parser — the
`alignedserve` dispatcher and the service's `main`, with `--check-config`, exactly as the process starts —
so a value the service refuses (`8Gi`, `prefetch: true`), a knob it does not have, or an address it must
not bind cannot ship again.

The pod's environment is built as the kubelet builds it: literal values, the downward API (a pod name of a
Deployment's shape, a pod IP), `$(VAR)` references; files the pod mounts from Secrets are made in a temp
directory and their mount paths mapped there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from chart_support import VALUE_SETS, Rendered, fullname
from pydantic import ByteSize, TypeAdapter

from alignedserve.bus.factory import make_bus
from alignedserve.bus.kafka import parse_url_security
from alignedserve.core import cli
from alignedserve.core.config import ENV_PREFIX

POD_IP = "10.42.3.17"
FN = fullname()
# the services' own settings classes, by command (for the knob names an env var may take)
SETTINGS = {
    "gateway": "alignedserve.gateway.config:GatewaySettings",
    "prefill": "alignedserve.prefill.config:PrefillSettings",
    "decode": "alignedserve.decode.config:DecodeSettings",
    "kvpool": "alignedserve.kvpool.config:KvPoolSettings",
    "batcher": "alignedserve.batcher.config:BatcherSettings",
}


def pod_name(owner: str) -> str:
    """What a Deployment's pod is called: <deployment>-<replicaset hash>-<5 chars>, at most 63."""
    return f"{owner}-7d9f8b6c5d-x2x4z"[-63:].lstrip("-") if len(owner) > 46 else f"{owner}-7d9f8b6c5d-x2x4z"


def containers(install: Rendered) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(owner name, kind, pod spec, container) of every container the chart runs, init containers too."""
    for manifest in install.manifests:
        if manifest["kind"] == "Deployment":
            spec = manifest["spec"]["template"]["spec"]
        elif manifest["kind"] == "Pod":
            spec = manifest["spec"]
        else:
            continue
        for container in [*spec.get("initContainers", []), *spec["containers"]]:  # init ones run first
            yield manifest["metadata"]["name"], manifest["kind"], spec, container


def our_containers(install: Rendered) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """Every container but the chart's own Redis: each names its command (the image's entry point)."""
    ours = [c for c in containers(install) if c[3]["name"] != "redis"]
    for owner, _, _, container in ours:
        assert container.get("command", [""])[0] in ("alignedserve", "alignedserve-loadgen"), owner
    return ours


class Pod:
    """The environment and files one container sees."""

    def __init__(self, install: Rendered, owner: str, kind: str, spec: dict[str, Any], tmp: Path) -> None:
        self.name = owner if kind == "Pod" else pod_name(owner)
        self.mounts: dict[str, Path] = {}
        secrets = {m["metadata"]["name"]: m for m in install.of_kind("Secret")}
        for volume in spec.get("volumes", []):
            if "secret" not in volume:
                continue
            folder = tmp / volume["name"]
            folder.mkdir(parents=True, exist_ok=True)
            made = secrets.get(volume["secret"]["secretName"], {}).get("data", {})
            items = volume["secret"].get("items") or [
                {"key": k, "path": k} for k in made or ("ca.crt", "tls.crt", "tls.key", "keys")
            ]
            for item in items:
                (folder / item["path"]).write_text("secret-from-the-test\n")
            self.mounts[volume["name"]] = folder
        self.paths: dict[str, Path] = {}
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] in self.mounts:
                    self.paths[mount["mountPath"]] = self.mounts[mount["name"]]

    def local(self, text: str) -> str:
        """A value naming a mounted file, pointed at the file the test made."""
        for mount_path, folder in self.paths.items():
            text = text.replace(mount_path, str(folder))
        return text

    def env(self, container: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        for item in container.get("env", []):
            if "value" in item:
                value = str(item["value"])
            else:
                field = item["valueFrom"]["fieldRef"]["fieldPath"]
                value = {"metadata.name": self.name, "status.podIP": POD_IP}[field]
            # the kubelet expands $(NAME) from the variables defined before it ($$ escapes)
            value = re.sub(
                r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value
            )
            env[item["name"]] = self.local(value)
        return env


def run_check_config(
    argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """The command's own entry point, in this process, with exactly this environment."""
    for name in list(os.environ):
        if name.startswith((ENV_PREFIX, "UCX_", "OPENAI_API_KEY")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    command, *args = argv
    if command == "alignedserve":
        code = cli.main([*args, "--check-config"])
    else:
        (script,) = entry_points(group="console_scripts", name=command)
        code = script.load()([*args, "--check-config"])
    out = capsys.readouterr()
    return code, out.out + out.err


def knobs(out: str) -> dict[str, str]:
    """--check-config's report: flag -> JSON value."""
    found = {}
    for line in out.splitlines():
        match = re.match(
            r"^\s+(--[a-z0-9-]+)\s+(.+?)\s+\((?:default|env [A-Z_]+|--[a-z0-9-]+|config .+)\)$", line
        )
        if match:
            found[match.group(1)] = match.group(2)
    return found


def load_settings(command: str) -> Any:
    module, _, name = SETTINGS[command].partition(":")
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_container_parses_with_its_services_own_config(
    rendered: dict[str, Rendered],
    value_set: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    install = rendered[value_set]
    ran = set()
    for owner, kind, spec, container in our_containers(install):
        pod = Pod(install, owner, kind, spec, tmp_path / owner)
        env = pod.env(container)
        argv = [pod.local(a) for a in [*container["command"], *container.get("args", [])]]
        code, out = run_check_config(argv, env, monkeypatch, capsys)
        assert code == 0, f"{value_set}: {owner}: {' '.join(argv)}\n{out}"
        assert "the configuration is valid" in out
        service = argv[1] if argv[0] == "alignedserve" else "loadgen"
        ran.add(service)
        if service != "loadgen":
            check_service(service, env, knobs(out), pod, container, install)
    assert ran == {"gateway", "prefill", "decode", "kvpool", "batcher"} | (
        {"loadgen"} if install.values.get("sloTest", {}).get("enabled", True) else set()
    )


def check_service(
    service: str,
    env: dict[str, str],
    shown: dict[str, str],
    pod: Pod,
    container: dict[str, Any],
    install: Rendered,
) -> None:
    settings = load_settings(service)
    # no ALIGNEDSERVE_* variable the service would silently ignore
    prefix = f"{ENV_PREFIX}{service.upper()}_"
    for name in env:
        if name.startswith(ENV_PREFIX):
            field = name.removeprefix(prefix) if name.startswith(prefix) else name.removeprefix(ENV_PREFIX)
            assert field.lower() in settings.model_fields, f"{pod.name}: {name} is not a {service} knob"
    # it listens on every address, under its pod's name
    if service == "gateway":
        assert shown["--host"] == '"0.0.0.0"' and shown["--gateway-id"] == f'"{pod.name}"'
        assert shown["--backend"] == '"bus"'
    else:
        assert shown["--metrics-host"] == '"0.0.0.0"' and shown["--worker-id"] == f'"{pod.name}"'
    if service in ("prefill", "decode", "kvpool"):
        assert shown["--advertise-host"] == f'"{POD_IP}"'
    # the bus URL is one the bus code takes (options, TLS/SASL settings, password files)
    bus = env["ALIGNEDSERVE_BUS"]
    if bus.startswith("kafka://"):
        _, _, security = parse_url_security(bus)
        assert Path(security.sasl_password_file or __file__).exists()
    else:
        make_bus(bus)  # redis-py parses the URL; a password_file is read here
    # a kvpool's budget fits in its container's memory limit
    if service == "kvpool":
        budget = TypeAdapter(ByteSize).validate_python(env["ALIGNEDSERVE_KVPOOL_POOL_BYTES"])
        assert budget < quantity_bytes(container["resources"]["limits"]["memory"])


def quantity_bytes(quantity: str) -> int:
    units = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }
    for unit, factor in units.items():
        if quantity.endswith(unit):
            return int(float(quantity.removesuffix(unit)) * factor)
    return int(quantity)


@pytest.mark.parametrize(
    ("env", "complaint"),
    [
        ({"ALIGNEDSERVE_KVPOOL_POOL_BYTES": "8Gi"}, "ALIGNEDSERVE_KVPOOL_POOL_BYTES"),
        ({"ALIGNEDSERVE_BATCHER_PREFETCH": "true"}, "ALIGNEDSERVE_BATCHER_PREFETCH"),
    ],
)
def test_check_config_exits_2_saying_what_is_wrong_and_how_to_fix_it(
    env: dict[str, str], complaint: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's two values: what the chart used to render, and what the services answer."""
    service = complaint.split("_")[1].lower()
    code, out = run_check_config(["alignedserve", service], env, monkeypatch, capsys)
    assert code == 2
    assert complaint in out and "fix it where the value is set" in out


# one wrong value for every command the chart runs: (argv, env, what the answer must name, how to fix it)
WRONG = {
    "gateway": (["alignedserve", "gateway"], {"ALIGNEDSERVE_GATEWAY_PORT": "80000"}, "ALIGNEDSERVE_GATEWAY_PORT"),
    "prefill": (["alignedserve", "prefill"], {"ALIGNEDSERVE_PREFILL_KV_CACHE_BYTES": "512Mi"},
                "ALIGNEDSERVE_PREFILL_KV_CACHE_BYTES"),
    "decode": (["alignedserve", "decode"], {"ALIGNEDSERVE_DECODE_MAX_NUM_SEQS": "lots"},
               "ALIGNEDSERVE_DECODE_MAX_NUM_SEQS"),
    "kvpool": (["alignedserve", "kvpool", "--transfer-port", "-1"], {}, "--transfer-port"),
    "batcher": (["alignedserve", "batcher"], {"ALIGNEDSERVE_BATCHER_POLICY": "lifo"}, "ALIGNEDSERVE_BATCHER_POLICY"),
}  # fmt: skip
FIX = "fix it where the value is set"


@pytest.mark.parametrize("command", [*sorted(WRONG), "loadgen"])
def test_every_command_the_chart_runs_refuses_a_wrong_value_with_exit_2_and_how_to_fix_it(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if command == "loadgen":  # the helm test's command: --fail-on-slo without a target to gate on
        argv = ["alignedserve-loadgen", "--endpoint", "http://gw:8000", "--model", "m", "--synthetic",
                "--concurrency", "2", "--fail-on-slo"]  # fmt: skip
        code, out = run_check_config(argv, {}, monkeypatch, capsys)
        assert code == 2 and "--fail-on-slo needs a target: --slo-ttft-ms" in out, out
        return
    argv, env, named = WRONG[command]
    code, out = run_check_config(argv, env, monkeypatch, capsys)
    assert code == 2, out
    assert named in out and FIX in out and f"alignedserve {command} --help" in out, out
    assert "the configuration is valid" not in out


def test_the_real_command_line_agrees(rendered: dict[str, Rendered], tmp_path: Path) -> None:
    """One container through a real process (`alignedserve gateway --check-config`), as the image runs it."""
    install = rendered["redis-bus"]
    owner, kind, spec, container = next(c for c in our_containers(install) if c[0] == f"{FN}-gateway")
    pod = Pod(install, owner, kind, spec, tmp_path)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    bindir = Path(sys.executable).parent
    result = subprocess.run(
        [str(bindir / "alignedserve"), *container["args"], "--check-config"],
        env={**clean, **pod.env(container)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert knobs(result.stdout)["--gateway-id"] == f'"{pod.name}"'
