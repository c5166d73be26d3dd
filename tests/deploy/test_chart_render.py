"""The chart renders through Helm's own engine with the defaults and every ci/ value set, passes
`helm lint --strict`, and every manifest validates against Kubernetes 1.31's schemas (custom resources
against their CRDs' fields); then what each install must hold, in its own words."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
from chart_support import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    Rendered,
    fullname,
    helm,
    render,
)
from custom_resources import PROMETHEUS_TRIGGER_METADATA, SCHEMAS

from alignedserve.loadgen.cli import build_parser, gate_from_args

COMPONENTS = ("gateway", "prefill", "decode", "kvpool", "batcher")
FN = fullname()


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_strict_passes(value_set: str) -> None:
    report = helm.lint(str(CHART), VALUE_SETS[value_set], strict=True, namespace=NAMESPACE,
                       kube_version=f"v{KUBE_VERSION}")  # fmt: skip
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_every_manifest_validates_against_the_kubernetes_1_31_schemas(rendered: dict[str, Rendered]) -> None:
    failures = []
    checked = 0
    for value_set, install in rendered.items():
        for manifest in install.manifests:
            if (manifest["apiVersion"], manifest["kind"]) in SCHEMAS:
                continue
            try:
                kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
                checked += 1
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path)
                failures.append(
                    f"{value_set}: {manifest['kind']}/{manifest['metadata']['name']}: {where}: {exc.message}"
                )
    assert not failures, "\n".join(failures)
    assert checked > 5 * len(rendered)


def test_custom_resources_have_the_fields_and_types_of_their_crds(rendered: dict[str, Rendered]) -> None:
    seen = set()
    for value_set, install in rendered.items():
        for manifest in install.manifests:
            key = (manifest["apiVersion"], manifest["kind"])
            if key not in SCHEMAS:
                continue
            seen.add(key[1])
            where = f"{value_set}: {key[1]}/{manifest['metadata']['name']}"
            try:
                jsonschema.validate(manifest, SCHEMAS[key])
                if key[1] == "ScaledObject":
                    for trigger in manifest["spec"]["triggers"]:
                        jsonschema.validate(trigger["metadata"], PROMETHEUS_TRIGGER_METADATA)
            except jsonschema.ValidationError as exc:
                pytest.fail(f"{where}: {'.'.join(map(str, exc.absolute_path))}: {exc.message}")
    assert seen == {"ServiceMonitor", "PrometheusRule", "ScaledObject"}  # the value sets cover each


def test_a_release_name_with_a_dot_is_refused_with_the_reason() -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError, match="holds a dot"):
        chart.render({}, name="my.release", namespace=NAMESPACE)


def _container(install: Rendered, component: str) -> dict:
    deployment = install.get("Deployment", f"{FN}-{component}")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_defaults_come_up_on_cpu_with_the_charts_own_redis(rendered: dict[str, Rendered]) -> None:
    install = rendered["defaults"]
    kinds = {(m["kind"], m["metadata"]["name"]) for m in install.manifests}
    for component in (*COMPONENTS, "redis"):
        assert ("Deployment", f"{FN}-{component}") in kinds
    assert ("Service", f"{FN}-gateway") in kinds and ("Pod", f"{FN}-slo-test") in kinds
    for component in ("prefill", "decode"):
        env = _env(_container(install, component))
        assert env[f"ALIGNEDSERVE_{component.upper()}_DEVICE"]["value"] == "cpu"
        assert "nvidia.com/gpu" not in _container(install, component)["resources"].get("limits", {})
    assert _env(_container(install, "gateway"))["ALIGNEDSERVE_BUS"]["value"] == f"redis://{FN}-redis:6379/0"
    assert "kubectl -n serving port-forward svc/demo-alignedserve-gateway 8000:8000" in install.notes
    assert "helm test demo -n serving" in install.notes


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_services_bind_all_addresses_and_take_their_identity_from_the_pod(
    rendered: dict[str, Rendered], value_set: str
) -> None:
    install = rendered[value_set]
    gateway = _env(_container(install, "gateway"))
    assert gateway["ALIGNEDSERVE_GATEWAY_HOST"]["value"] == "0.0.0.0"
    assert gateway["ALIGNEDSERVE_GATEWAY_PORT"]["value"] == str(
        install.values.get("gateway", {}).get("port", 8000)
    )
    assert gateway["ALIGNEDSERVE_GATEWAY_GATEWAY_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    for component in COMPONENTS[1:]:
        env = _env(_container(install, component))
        svc = component.upper()
        assert env[f"ALIGNEDSERVE_{svc}_METRICS_HOST"]["value"] == "0.0.0.0"
        assert env[f"ALIGNEDSERVE_{svc}_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        if component != "batcher":
            assert (
                env[f"ALIGNEDSERVE_{svc}_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
                == "status.podIP"
            )


def test_the_release_name_namespaces_every_services_bus(rendered: dict[str, Rendered]) -> None:
    install = rendered["defaults"]
    for component in COMPONENTS:
        assert _env(_container(install, component))["ALIGNEDSERVE_DEPLOYMENT"]["value"] == RELEASE


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_pod_is_locked_down(rendered: dict[str, Rendered], value_set: str) -> None:
    for name, spec in rendered[value_set].pod_specs():
        assert spec["enableServiceLinks"] is False, name  # no <SVC>_PORT=tcp://... beside our env vars
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["capabilities"]["drop"] == ["ALL"], name
            assert "limits" in container["resources"] and "requests" in container["resources"], name


def test_the_batcher_is_a_guarded_singleton(rendered: dict[str, Rendered]) -> None:
    for install in rendered.values():
        batcher = install.get("Deployment", f"{FN}-batcher")
        assert batcher["spec"]["replicas"] == 1
        assert batcher["spec"]["strategy"] == {"type": "Recreate"}  # never two during a rollout


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_probes_are_sized_for_model_load_and_each_component_has_a_pdb(
    rendered: dict[str, Rendered], value_set: str
) -> None:
    install = rendered[value_set]
    probes = install.values.get("probes", {}).get("startup", {"periodSeconds": 10, "failureThreshold": 90})
    pdbs = {m["metadata"]["name"] for m in install.of_kind("PodDisruptionBudget")}
    for component in COMPONENTS:
        container = _container(install, component)
        startup = container["startupProbe"]
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container)
        if component in ("prefill", "decode"):  # ready = model loaded: the startup budget is the load time
            assert startup["httpGet"]["path"] == "/ready"
            assert startup["periodSeconds"] * startup["failureThreshold"] == (
                probes["periodSeconds"] * probes["failureThreshold"]
            )
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert f"{FN}-{component}" in pdbs


def test_gpu_pods_request_gpus_and_are_co_scheduled_on_one_nvlink_domain(
    rendered: dict[str, Rendered],
) -> None:
    install = rendered["gpu-nvlink"]
    for component in ("prefill", "decode"):
        deployment = install.get("Deployment", f"{FN}-{component}")
        spec = deployment["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert container["image"] == f"registry.example.com/ml/alignedserve-{component}-cuda:0.1.0"
        env = _env(container)
        assert env[f"ALIGNEDSERVE_{component.upper()}_DEVICE"]["value"] == "cuda"
        assert env["UCX_TLS"]["value"] == "rc,cuda_copy,cuda_ipc"
        assert env["UCX_NET_DEVICES"]["value"] == "mlx5_0:1"
        assert spec["nodeSelector"] == {"node-pool": "inference", "nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert {
            "key": "dedicated",
            "operator": "Equal",
            "value": "inference",
            "effect": "NoSchedule",
        } in spec["tolerations"]
        assert spec["priorityClassName"] == "inference-high"
        pod_affinity = spec["affinity"]["podAffinity"]
        node_terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert node_terms["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.clique"
        if component == "decode":  # decode goes where a prefill worker is, in the same NVLink domain
            term = pod_affinity["requiredDuringSchedulingIgnoredDuringExecution"][0]
            assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"
        else:
            term = pod_affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
            assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
        assert term["topologyKey"] == "nvidia.com/gpu.clique"
    kvpool = install.get("Deployment", f"{FN}-kvpool")["spec"]["template"]["spec"]
    assert "podAntiAffinity" in kvpool["affinity"]  # a component's own affinity is kept
    assert kvpool["nodeSelector"] == {"node-pool": "inference"}  # no GPU selector for the pool


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_pod_that_needs_the_model_or_tokenizer_mounts_it(
    rendered: dict[str, Rendered], value_set: str
) -> None:
    install = rendered[value_set]
    source = install.values.get("model", {}).get("source", "bundled")
    for name, spec in install.pod_specs():
        needs = any(name.endswith(suffix) for suffix in ("-gateway", "-prefill", "-decode", "-slo-test"))
        mounts = {m["name"]: m for m in spec["containers"][0].get("volumeMounts", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        if source == "bundled" or not needs:
            assert "model" not in mounts, name
            continue
        assert mounts["model"]["mountPath"] == "/models" and mounts["model"]["readOnly"] is True, name
        assert ("persistentVolumeClaim" if source == "pvc" else "image") in volumes["model"], name


def test_secrets_are_files_and_the_bus_url_names_them(rendered: dict[str, Rendered]) -> None:
    kafka = _env(_container(rendered["kafka-sasl-tls"], "decode"))["ALIGNEDSERVE_BUS"]["value"]
    assert kafka.startswith("kafka://kafka-0.kafka.messaging.svc:9093,kafka-1.kafka.messaging.svc:9093?")
    for option in ("security_protocol=SASL_SSL", "sasl_mechanism=SCRAM-SHA-512", "sasl_username=alignedserve",
                   "sasl_password_file=/etc/alignedserve/bus-auth/password", "ssl_cafile=/etc/alignedserve/bus-tls/ca.crt",
                   "ssl_certfile=/etc/alignedserve/bus-tls/tls.crt"):  # fmt: skip
        assert option in kafka
    redis = _env(_container(rendered["external-brokers"], "gateway"))["ALIGNEDSERVE_BUS"]["value"]
    assert redis.startswith("rediss://alignedserve@redis.data.svc:6380/3?password_file=")
    for install in rendered.values():
        for name, spec in install.pod_specs():
            for container in spec["containers"]:
                for env in container.get("env", []):
                    assert "secretKeyRef" not in env.get("valueFrom", {}), f"{name}: {env['name']}"
    made = rendered["redis-bus"].get("Secret", f"{FN}-bus-auth")
    assert set(made["data"]) == {"password"}


def test_the_gateway_reads_the_api_keys_secret_it_mounts(rendered: dict[str, Rendered]) -> None:
    gateway = _container(rendered["redis-bus"], "gateway")
    key_file = _env(gateway)["ALIGNEDSERVE_GATEWAY_API_KEY_FILE"]["value"]
    assert key_file.rpartition("/")[0] in [m["mountPath"] for m in gateway["volumeMounts"]]
    assert set(rendered["redis-bus"].get("Secret", f"{FN}-api-keys")["data"]) == {"keys"}
    open_gateway = _container(rendered["defaults"], "gateway")  # no apiKeys: the API stays open
    assert "ALIGNEDSERVE_GATEWAY_API_KEY_FILE" not in _env(open_gateway)


def test_autoscaling_leaves_replicas_to_the_autoscaler(rendered: dict[str, Rendered]) -> None:
    keda = rendered["kafka-sasl-tls"]
    for component in ("gateway", "prefill", "decode"):
        assert "replicas" not in keda.get("Deployment", f"{FN}-{component}")["spec"]
        scaled = keda.get("ScaledObject", f"{FN}-{component}")
        assert scaled["spec"]["scaleTargetRef"]["name"] == f"{FN}-{component}"
    query = keda.get("ScaledObject", f"{FN}-prefill")["spec"]["triggers"][0]["metadata"]["query"]
    assert "alignedserve:bus_consume_lag_seconds_bucket" in query and 'group="prefill"' in query
    hpa = rendered["redis-bus"].get("HorizontalPodAutoscaler", f"{FN}-gateway")
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "alignedserve_num_requests_waiting"


def test_network_policies_keep_the_data_plane_among_its_workers(rendered: dict[str, Rendered]) -> None:
    install = rendered["redis-bus"]
    decode = install.get("NetworkPolicy", f"{FN}-decode")
    peers = [
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for p in decode["spec"]["ingress"][1]["from"]
    ]
    assert peers == ["prefill", "decode", "kvpool"]
    assert install.get("NetworkPolicy", f"{FN}-redis")["spec"]["ingress"][0]["ports"] == [
        {"port": "redis", "protocol": "TCP"}
    ]
    assert (
        RELEASE
        in install.get("NetworkPolicy", f"{FN}-gateway")["metadata"]["labels"]["app.kubernetes.io/instance"]
    )


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_test_runs_the_load_generators_slo_gate(rendered: dict[str, Rendered], value_set: str) -> None:
    """`helm test` is the load generator against the gateway's Service, with a gate that fails the hook
    (exit 3) on a missed SLO: its args read by the load generator's own parser."""
    install = rendered[value_set]
    pod = install.get("Pod", f"{FN}-slo-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["alignedserve-loadgen"]
    argv = list(container["args"])
    if "--api-key-file" in argv:  # read as it is parsed: a file of the pod's, mounted from the Secret
        at = argv.index("--api-key-file")
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert argv[at + 1].rpartition("/")[0] in mounts
        del argv[at : at + 2]
    args = build_parser().parse_args(argv)
    port = install.values.get("gateway", {}).get("port", 8000)
    assert args.endpoint == f"http://{FN}-gateway:{port}"
    assert args.fail_on_slo and gate_from_args(args).any
    assert args.wait_ready > 0  # the gateway may still be loading its tokenizer


def test_cpu_nodes_can_have_the_decode_worker_pull_ahead_from_the_pool_instead_of_staging(
    rendered: dict[str, Rendered],
) -> None:
    """`alignedserve up --prefetch decode` as values: the batcher stages nothing and the decode worker
    pre-pulls from the pool; the defaults keep staging in a prefill worker (GPU-to-GPU prefetch)."""
    defaults = rendered["defaults"]
    assert _env(_container(defaults, "decode"))["ALIGNEDSERVE_DECODE_PREFETCH_FROM_POOL"]["value"] == "false"
    assert _env(_container(defaults, "batcher"))["ALIGNEDSERVE_BATCHER_PREFETCH"]["value"] == "on"
    install = render({"decode": {"prefetchFromPool": True}, "batcher": {"prefetch": "off"}})
    assert _env(_container(install, "decode"))["ALIGNEDSERVE_DECODE_PREFETCH_FROM_POOL"]["value"] == "true"
    assert _env(_container(install, "batcher"))["ALIGNEDSERVE_BATCHER_PREFETCH"]["value"] == "off"
