"""The Helm chart in helm/pagedserve, linted and rendered by the real Helm engine.

helm-python-sdk embeds Helm's Go library, so these tests need no helm binary and no cluster.
Rendered manifests of core kinds are validated strictly (unknown fields rejected) against the
Kubernetes OpenAPI schemas that kubernetes-validate ships, for the oldest Kubernetes release
the chart supports and a recent one.
"""

from __future__ import annotations

import base64
import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, ClassVar

import kubernetes_validate
import pytest
import yaml

from tests.deploy.crd import CrdError, CustomResourceDefinition

try:
    import helm_python as helm
except ImportError as error:  # a setup mistake, not a platform limit: fail loudly
    raise ImportError("tests/deploy needs helm-python-sdk: pip install -e '.[dev]'") from error
except Exception as error:  # installed, but its native Helm library cannot load here
    pytest.skip(f"helm-python-sdk cannot load Helm here: {error}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "pagedserve"
EXAMPLE_VALUES = sorted((ROOT / "deploy" / "values").glob("*.yaml"))
# Chart files that are symlinks to the one copy of each artifact in deploy/.
LINKED_FILES = {
    "files/grafana/pagedserve.json": ROOT / "deploy" / "grafana" / "pagedserve.json",
    "files/prometheus/alerts.yaml": ROOT / "deploy" / "prometheus" / "alerts.yaml",
}
# The Gateway API Inference Extension's InferencePool CRD, as its v1.6.0 release publishes it.
INFERENCE_POOL_CRD = CustomResourceDefinition(
    ROOT / "tests/data/gateway-api-inference-extension/inferencepools-v1.6.0.yaml"
)
# Gateway API's HTTPRoute CRD, standard channel, as its v1.6.1 release publishes it.
HTTP_ROUTE_CRD = CustomResourceDefinition(ROOT / "tests/data/gateway-api/httproutes-v1.6.1.yaml")
# Chart.yaml says kubeVersion >=1.25: the oldest supported release and a recent one.
KUBE_VERSIONS = ("1.25", "1.35")

PROMETHEUS = {"serverAddress": "http://prometheus-operated.monitoring.svc:9090"}
EVERYTHING = {
    "gpu": {"count": 1},
    "model": {"source": "pvc", "path": "Llama-3.1-8B-Instruct"},
    "apiKey": {"value": "test-key"},
    "apiKeys": {"existingSecret": "tenant-keys"},
    "serviceMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
}
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything-with-hpa": {**EVERYTHING, "autoscaling": {"enabled": True}},
    "everything-with-keda": {**EVERYTHING, "keda": {"enabled": True, "prometheus": PROMETHEUS}},
    "hostpath-model": {"model": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}}},
    "inference-pool-with-kv-events": {
        "inferencePool": {
            "enabled": True,
            "httpRoute": {"enabled": True, "hostnames": ["llm.example.com"]},
        },
        "kvEvents": {"enabled": True},
        "gpu": {"count": 1},
        "server": {"tensorParallelSize": 2, "servedModelName": "llama"},
    },
    "inference-pool-with-two-pickers": {
        "inferencePool": {"enabled": True, "endpointPicker": {"replicas": 2}},
    },
    "inference-pool-with-tenants": {
        "inferencePool": {"enabled": True},
        "kvEvents": {"enabled": True},
        "apiKeys": {"existingSecret": "tenant-keys"},
        "server": {"renderAllowFrom": ["10.244.0.0/16"]},
    },
    "lora-from-a-claim-behind-a-pool": {
        "inferencePool": {"enabled": True},
        "lora": {
            "enabled": True,
            "maxLoras": 4,
            "source": "pvc",
            "pvc": {"existingClaim": "adapters", "subPath": "llama"},
            "adapters": [{"name": "sql", "path": "sql-lora"}, {"name": "chat"}],
        },
    },
    "lora-from-config-maps": {
        "lora": {
            "enabled": True,
            "source": "configMap",
            "adapters": [
                {"name": "sql", "configMap": "sql-lora"},
                {"name": "chat", "configMap": "chat-lora"},
            ],
        },
    },
    **{f"example-{path.stem}": helm.values_from_yaml(path.read_text()) for path in EXAMPLE_VALUES},
}


def render(
    values: dict[str, Any] | None = None, *, release: str = "demo", namespace: str = "llm"
) -> list[dict[str, Any]]:
    """The chart's manifests for `values`, as `helm template` would produce them."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values or {}, name=release, namespace=namespace)
    return [
        manifest
        for path, text in sorted(rendered.items())
        if path.endswith(".yaml")
        for manifest in yaml.safe_load_all(text)
        if manifest
    ]


def is_epp(manifest: dict[str, Any]) -> bool:
    """Whether `manifest` is one of the endpoint picker's (templates/endpoint-picker.yaml)."""
    labels = manifest["metadata"].get("labels", {})
    return labels.get("app.kubernetes.io/component") == "endpoint-picker"


def the(manifests: list[dict[str, Any]], kind: str, *, epp: bool = False) -> dict[str, Any]:
    """The one manifest of `kind`: the server's, or with `epp` the endpoint picker's."""
    found = [m for m in manifests if m["kind"] == kind and is_epp(m) == epp]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def kinds(manifests: list[dict[str, Any]]) -> set[str]:
    return {m["kind"] for m in manifests}


def server_container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    containers = the(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "server")


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value, or -> valueFrom for variables read from elsewhere."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# --- Custom resources -----------------------------------------------------------------------
# ServiceMonitor and PrometheusRule (Prometheus Operator) and ScaledObject (KEDA) are CRDs,
# absent from the core schemas kubernetes-validate carries. They are checked by hand instead:
# apiVersion and kind, and the fields their controllers require or this chart relies on.


def check_service_monitor(monitor: dict[str, Any]) -> None:
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"]
    assert spec["endpoints"]
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] == "http"
        assert endpoint["path"] == "/metrics"


def check_prometheus_rule(rule: dict[str, Any]) -> None:
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    groups = rule["spec"]["groups"]
    assert groups
    for group in groups:
        assert isinstance(group["name"], str) and group["name"]
        assert group["rules"]
        for item in group["rules"]:
            assert isinstance(item["expr"], str) and item["expr"].strip()
            assert ("alert" in item) != ("record" in item), item
            for field in ("labels", "annotations"):
                assert all(isinstance(v, str) for v in item.get(field, {}).values())


def check_scaled_object(scaled: dict[str, Any]) -> None:
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"]
    assert spec["triggers"]
    for trigger in spec["triggers"]:
        assert trigger["type"]
        # KEDA's trigger metadata is a map of strings.
        assert all(isinstance(v, str) for v in trigger["metadata"].values())


CUSTOM_RESOURCE_CHECKS = {
    "ServiceMonitor": check_service_monitor,
    "PrometheusRule": check_prometheus_rule,
    "ScaledObject": check_scaled_object,
    "InferencePool": INFERENCE_POOL_CRD.validate,
    "HTTPRoute": HTTP_ROUTE_CRD.validate,
}


# --- Lint, render, validate -----------------------------------------------------------------


def test_example_values_exist() -> None:
    assert {path.stem for path in EXAMPLE_VALUES} >= {"cpu", "gpu-llama-3.1-8b"}


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_helm_lint_is_clean(variant: str, kube_version: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=True, kube_version=f"v{kube_version}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["errors"] == [] and problems == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_match_kubernetes_schemas(variant: str, kube_version: str) -> None:
    manifests = render(VARIANTS[variant])
    assert {"Deployment", "Service"} <= kinds(manifests)
    for manifest in manifests:
        check = CUSTOM_RESOURCE_CHECKS.get(manifest["kind"])
        if check is not None:
            check(manifest)
        else:
            kubernetes_validate.validate(manifest, kube_version, strict=True)


def test_the_schema_validator_has_teeth() -> None:
    """The validation above can fail: a misspelled field is rejected."""
    deployment = the(render(), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[0], strict=True)


def test_all_features_render() -> None:
    assert kinds(render(VARIANTS["everything-with-hpa"])) >= {
        "Deployment",
        "Service",
        "ServiceAccount",
        "Secret",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
    }
    assert "ScaledObject" in kinds(render(VARIANTS["everything-with-keda"]))


# --- values.schema.json ---------------------------------------------------------------------

BAD_VALUES = {
    "replicaCount-as-word": {"replicaCount": "two"},
    "unknown-top-level-key": {"replicas": 2},
    "misspelled-server-flag": {"server": {"maxNumSeq": 8}},
    "server-flag-wrong-type": {"server": {"maxNumSeqs": "many"}},
    "unknown-dtype": {"server": {"dtype": "int8"}},
    "unknown-model-source": {"model": {"source": "s3"}},
    "negative-gpu-count": {"gpu": {"count": -1}},
    "port-out-of-range": {"server": {"port": 70000}},
    "no-grace-margin": {"shutdown": {"graceMarginSeconds": 0}},
    "api-keys-unknown-field": {"apiKeys": {"existingSecret": "k", "file": "keys"}},
    "api-keys-relative-mount": {"apiKeys": {"existingSecret": "k", "mountPath": "keys"}},
    "queue-limit-zero": {"server": {"maxNumQueuedReqs": 0}},
    "tenant-limit-as-word": {"server": {"maxConcurrentRequestsPerTenant": "few"}},
    "epp-unknown-key": {"inferencePool": {"endpointPicker": {"imageTag": "v1"}}},
    "epp-zero-replicas": {"inferencePool": {"endpointPicker": {"replicas": 0}}},
    "epp-unknown-pull-policy": {
        "inferencePool": {"endpointPicker": {"image": {"pullPolicy": "Sometimes"}}}
    },
    "route-unknown-key": {"inferencePool": {"httpRoute": {"path": "/v1"}}},
    "route-timeout-in-words": {"inferencePool": {"httpRoute": {"requestTimeout": "5 minutes"}}},
    "route-timeout-too-long": {"inferencePool": {"httpRoute": {"requestTimeout": "123456s"}}},
    "route-hostname-not-dns": {"inferencePool": {"httpRoute": {"hostnames": ["LLM_host"]}}},
    "route-gateway-unnamed": {"inferencePool": {"httpRoute": {"gateway": {"name": ""}}}},
    "epp-unknown-failure-mode": {"inferencePool": {"endpointPicker": {"failureMode": "Open"}}},
    "replay-port-out-of-range": {"kvEvents": {"replayPort": 0}},
    "render-allow-from-a-name": {"server": {"renderAllowFrom": ["cluster"]}},
    "render-allow-from-a-string": {"server": {"renderAllowFrom": "10.0.0.0/8"}},
    "lora-unknown-key": {"lora": {"enabled": True, "maxAdapters": 4}},
    "lora-zero-max-loras": {"lora": {"enabled": True, "maxLoras": 0}},
    "lora-rank-as-word": {"lora": {"enabled": True, "maxLoraRank": "high"}},
    "lora-unknown-source": {"lora": {"enabled": True, "source": "s3"}},
    "lora-relative-mount": {"lora": {"enabled": True, "mountPath": "adapters"}},
    "lora-claim-not-a-name": {"lora": {"pvc": {"existingClaim": "My_Claim"}}},
    "lora-sub-path-escapes": {"lora": {"pvc": {"subPath": "../other"}}},
    "lora-adapter-unnamed": {"lora": {"adapters": [{"path": "sql"}]}},
    "lora-adapter-unknown-key": {"lora": {"adapters": [{"name": "sql", "dir": "sql"}]}},
    # A comma or a space would split the --lora-modules list the server reads.
    "lora-adapter-name-with-comma": {"lora": {"adapters": [{"name": "a,b"}]}},
    "lora-adapter-name-with-slash": {"lora": {"adapters": [{"name": "org/sql"}]}},
    "lora-adapter-absolute-path": {"lora": {"adapters": [{"name": "sql", "path": "/sql"}]}},
    "lora-adapter-path-escapes": {"lora": {"adapters": [{"name": "sql", "path": "a/../../b"}]}},
    "lora-adapter-path-with-space": {"lora": {"adapters": [{"name": "sql", "path": "my sql"}]}},
    "lora-adapter-config-map-not-a-name": {
        "lora": {"adapters": [{"name": "sql", "configMap": "SQL"}]}
    },
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_rejects_bad_values(values: dict[str, Any]) -> None:
    with helm.Chart.load(CHART) as chart:
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(values)
        with pytest.raises(helm.HelmValuesError):
            chart.render(values, name="demo")
    assert helm.lint(CHART, values)["errors"]


def test_schema_error_names_the_offending_key() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError) as raised:
        chart.render({"replicaCount": "two"}, name="demo")
    assert "replicaCount" in str(raised.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"autoscaling": {"enabled": True}, "keda": {"enabled": True, "prometheus": PROMETHEUS}},
            "mutually exclusive",
        ),
        ({"keda": {"enabled": True}}, "serverAddress"),
        ({"model": {"source": "hostPath"}}, "hostPath.path"),
        ({"model": {"source": "image", "path": "relative/dir"}}, "absolute"),
        (
            {"responses": {"persistence": {"enabled": True}, "redis": {"existingSecret": "r"}}},
            "enable one",
        ),
        ({"responses": {"persistence": {"enabled": True}}, "replicaCount": 2}, "responses.redis"),
        (
            {
                "inferencePool": {"enabled": True},
                "kvEvents": {"enabled": True},
                "apiKey": {"value": "k"},
            },
            "needs server.renderAllowFrom: the endpoint picker",
        ),
        (
            {
                "inferencePool": {"enabled": True},
                "kvEvents": {"enabled": True},
                "apiKeys": {"existingSecret": "tenant-keys"},
            },
            "needs server.renderAllowFrom",
        ),
        ({"kvEvents": {"enabled": True, "port": 6000, "replayPort": 6000}}, "must differ"),
    ],
)
def test_template_rejects_contradictory_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


CLAIM = {"enabled": True, "source": "pvc", "pvc": {"existingClaim": "adapters"}}
# Combinations of lora values the templates refuse, and the words their message must carry.
LORA_CONTRADICTIONS = {
    "adapters-without-lora": (
        {"lora": {"source": "pvc", "adapters": [{"name": "sql"}]}},
        "need lora.enabled",
    ),
    "adapters-without-a-source": (
        {"lora": {"enabled": True, "adapters": [{"name": "sql"}]}},
        r"lora.adapters need lora.source \(pvc or configMap\)",
    ),
    "claim-unnamed": (
        {"lora": {"enabled": True, "source": "pvc"}},
        r"lora.source=pvc needs lora.pvc.existingClaim",
    ),
    "config-map-source-without-adapters": (
        {"lora": {"enabled": True, "source": "configMap"}},
        "needs lora.adapters, each naming its configMap",
    ),
    "config-map-adapter-without-its-config-map": (
        {"lora": {"enabled": True, "source": "configMap", "adapters": [{"name": "sql"}]}},
        '"sql" needs a configMap',
    ),
    "config-map-adapter-with-a-path": (
        {
            "lora": {
                "enabled": True,
                "source": "configMap",
                "adapters": [{"name": "sql", "configMap": "sql-lora", "path": "sql"}],
            }
        },
        '"sql" has a path, which is for lora.source=pvc',
    ),
    "claim-adapter-with-a-config-map": (
        {"lora": CLAIM | {"adapters": [{"name": "sql", "configMap": "sql-lora"}]}},
        '"sql" has a configMap, which is for lora.source=configMap',
    ),
    "duplicate-names": (
        {"lora": CLAIM | {"adapters": [{"name": "sql"}, {"name": "sql", "path": "sql-v2"}]}},
        '"sql" is listed twice',
    ),
    "named-as-the-served-model": (
        {"server": {"servedModelName": "llama"}, "lora": CLAIM | {"adapters": [{"name": "llama"}]}},
        '"llama" is the served model name',
    ),
    "named-as-the-model-directory": (
        {
            "model": {"source": "pvc", "path": "Llama-3.1-8B-Instruct"},
            "lora": CLAIM | {"adapters": [{"name": "Llama-3.1-8B-Instruct"}]},
        },
        "is the served model name",
    ),
    "with-tensor-parallelism": (
        {"gpu": {"count": 1}, "server": {"tensorParallelSize": 2}, "lora": {"enabled": True}},
        r"lora.enabled needs server.tensorParallelSize 1",
    ),
    "fewer-cpu-than-gpu-adapters": (
        {"lora": {"enabled": True, "maxLoras": 4, "maxCpuLoras": 2}},
        r"lora.maxCpuLoras \(2\) is below lora.maxLoras \(4\)",
    ),
    "adapters-where-the-model-is": (
        {"model": {"source": "pvc", "mountPath": "/data/"}, "lora": CLAIM | {"mountPath": "/data"}},
        "lora.mountPath and model.mountPath must differ",
    ),
}


@pytest.mark.parametrize(
    ("values", "message"), LORA_CONTRADICTIONS.values(), ids=LORA_CONTRADICTIONS.keys()
)
def test_template_rejects_contradictory_lora_values(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


# --- The pod and the server -----------------------------------------------------------------


@pytest.mark.parametrize("port", [8000, 9123])
def test_probes_target_the_port_the_server_listens_on(port: int) -> None:
    manifests = render({"server": {"port": port}})
    container = server_container(manifests)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(env_of(container)["PAGEDSERVE_PORT"]) == port
    assert list(ports.values()) == [port]

    def resolve(target: int | str) -> int:
        return ports[target] if isinstance(target, str) else target

    for probe, path in [
        ("startupProbe", "/ready"),
        ("readinessProbe", "/ready"),
        ("livenessProbe", "/health"),
    ]:
        http_get = container[probe]["httpGet"]
        assert http_get["path"] == path, probe
        assert resolve(http_get["port"]) == port, probe
    service_ports = the(manifests, "Service")["spec"]["ports"]
    assert [resolve(p["targetPort"]) for p in service_ports] == [port]


def test_startup_probe_allows_slow_model_loading() -> None:
    startup = server_container(render())["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


GRACE_CASES = {
    "defaults": {},
    "long-drain": {"server": {"shutdownTimeout": 300}},
    "no-prestop-sleep": {"shutdown": {"preStopSleepSeconds": 0}},
    "slow-load-balancer": {"shutdown": {"preStopSleepSeconds": 45, "graceMarginSeconds": 1}},
    **{name: values for name, values in VARIANTS.items() if name.startswith("example-")},
}


@pytest.mark.parametrize("values", GRACE_CASES.values(), ids=GRACE_CASES.keys())
def test_grace_period_outlasts_prestop_sleep_and_drain(values: dict[str, Any]) -> None:
    deployment = the(render(values), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = server_container([deployment])
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    sleep, drain = int(command[1]), int(env_of(container)["PAGEDSERVE_SHUTDOWN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] > sleep + drain


# Every values key under `server`, and the variable the server reads it from (flag name
# without dashes, uppercased, '-' -> '_'), with a sample value and its rendering.
SERVER_FLAGS = {
    "port": ("PAGEDSERVE_PORT", 8080, "8080"),
    "shutdownTimeout": ("PAGEDSERVE_SHUTDOWN_TIMEOUT", 45, "45"),
    "servedModelName": ("PAGEDSERVE_SERVED_MODEL_NAME", "llama", "llama"),
    "dtype": ("PAGEDSERVE_DTYPE", "bfloat16", "bfloat16"),
    "device": ("PAGEDSERVE_DEVICE", "cuda", "cuda"),
    "attentionBackend": ("PAGEDSERVE_ATTENTION_BACKEND", "flashinfer", "flashinfer"),
    "blockSize": ("PAGEDSERVE_BLOCK_SIZE", 32, "32"),
    "maxNumSeqs": ("PAGEDSERVE_MAX_NUM_SEQS", 64, "64"),
    "maxNumBatchedTokens": ("PAGEDSERVE_MAX_NUM_BATCHED_TOKENS", 4096, "4096"),
    "maxModelLen": ("PAGEDSERVE_MAX_MODEL_LEN", 8192, "8192"),
    "numKvBlocks": ("PAGEDSERVE_NUM_KV_BLOCKS", 1000, "1000"),
    # Helm holds numbers as float64; a large byte count must not come out as 4.294967296e+09.
    "kvCacheMemory": ("PAGEDSERVE_KV_CACHE_MEMORY", 4294967296, "4294967296"),
    "gpuMemoryUtilization": ("PAGEDSERVE_GPU_MEMORY_UTILIZATION", 0.85, "0.85"),
    "enablePrefixCaching": ("PAGEDSERVE_ENABLE_PREFIX_CACHING", False, "false"),
    "enforceEager": ("PAGEDSERVE_ENFORCE_EAGER", True, "true"),
    "numThreads": ("PAGEDSERVE_NUM_THREADS", 4, "4"),
    "stallTimeout": ("PAGEDSERVE_STALL_TIMEOUT", 120, "120"),
    "maxRequestBytes": ("PAGEDSERVE_MAX_REQUEST_BYTES", "32MiB", "32MiB"),
    "maxNumQueuedReqs": ("PAGEDSERVE_MAX_NUM_QUEUED_REQS", 512, "512"),
    "maxNumQueuedTokens": ("PAGEDSERVE_MAX_NUM_QUEUED_TOKENS", 262144, "262144"),
    "maxConcurrentRequestsPerTenant": ("PAGEDSERVE_MAX_CONCURRENT_REQUESTS_PER_TENANT", 8, "8"),
    "tensorParallelSize": ("PAGEDSERVE_TENSOR_PARALLEL_SIZE", 2, "2"),
    "tenantMetrics": ("PAGEDSERVE_TENANT_METRICS", True, "true"),
    "logRequests": ("PAGEDSERVE_LOG_REQUESTS", False, "false"),
    "responsesTtl": ("PAGEDSERVE_RESPONSES_TTL", 86400, "86400"),
    "disableDashboard": ("PAGEDSERVE_DISABLE_DASHBOARD", True, "true"),
    "logLevel": ("PAGEDSERVE_LOG_LEVEL", "debug", "debug"),
    "logFormat": ("PAGEDSERVE_LOG_FORMAT", "text", "text"),
    # A list is comma-separated, as the server splits a repeatable flag's variable.
    "renderAllowFrom": (
        "PAGEDSERVE_RENDER_ALLOW_FROM",
        ["10.244.0.0/16", "fd00::/8"],
        "10.244.0.0/16,fd00::/8",
    ),
}


def test_every_server_value_is_a_known_flag() -> None:
    with helm.Chart.load(CHART) as chart:
        assert set(chart.values["server"]) == set(SERVER_FLAGS)


def test_every_server_env_var_is_read_by_the_cli() -> None:
    """The chart's variables are exactly ones `pagedserve serve` reads (PAGEDSERVE_<DEST>)."""
    import argparse

    from server.cli import add_serve_arguments, env_name

    serve = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(serve)
    known = {env_name(action.dest) for action in serve._actions}
    assert {name for name, _, _ in SERVER_FLAGS.values()} <= known


def test_server_values_become_pagedserve_env_vars() -> None:
    values = {key: sample for key, (_, sample, _) in SERVER_FLAGS.items()}
    env = env_of(server_container(render({"server": values})))
    assert {name: env[name] for name, _, _ in SERVER_FLAGS.values()} == {
        name: rendered for name, _, rendered in SERVER_FLAGS.values()
    }


def test_unset_server_flags_are_left_to_the_server() -> None:
    env = env_of(server_container(render({"server": {"servedModelName": "", "maxNumSeqs": None}})))
    assert "PAGEDSERVE_SERVED_MODEL_NAME" not in env
    assert "PAGEDSERVE_MAX_NUM_SEQS" not in env


def test_api_key_from_a_created_secret() -> None:
    manifests = render({"apiKey": {"value": "s3cret"}})
    secret = the(manifests, "Secret")
    ref = env_of(server_container(manifests))["PAGEDSERVE_API_KEY"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert base64.b64decode(secret["data"][ref["key"]]) == b"s3cret"


def test_api_key_from_an_existing_secret() -> None:
    values = {"apiKey": {"existingSecret": "team-keys", "secretKey": "pagedserve", "value": "x"}}
    manifests = render(values)
    assert "Secret" not in kinds(manifests)
    ref = env_of(server_container(manifests))["PAGEDSERVE_API_KEY"]["secretKeyRef"]
    assert ref == {"name": "team-keys", "key": "pagedserve"}


def test_api_keys_file_from_an_existing_secret() -> None:
    values = {"apiKeys": {"existingSecret": "tenant-keys"}, "apiKey": {"existingSecret": "k"}}
    manifests = render(values)
    pod = the(manifests, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume["secret"] == {
        "secretName": "tenant-keys",
        "items": [{"key": "api-keys", "path": "api-keys"}],
    }
    container = server_container(manifests)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert mount == {"name": "api-keys", "mountPath": "/etc/pagedserve/api-keys", "readOnly": True}
    env = env_of(container)
    assert env["PAGEDSERVE_API_KEYS_FILE"] == "/etc/pagedserve/api-keys/api-keys"
    assert env["PAGEDSERVE_API_KEY"]["secretKeyRef"]["name"] == "k"  # both kinds of key


def test_the_server_reads_the_keys_file_the_chart_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from server.cli import build_parser, configs_from_args
    from server.tenants import KeyRing

    values = {"apiKeys": {"existingSecret": "s", "secretKey": "keys.txt", "mountPath": "/k/"}}
    env = env_of(server_container(render(values)))
    assert env["PAGEDSERVE_API_KEYS_FILE"] == "/k/keys.txt"
    keys = tmp_path / "keys.txt"
    keys.write_text("secret-1 team-a\n")
    monkeypatch.setenv("PAGEDSERVE_API_KEYS_FILE", str(keys))  # the chart's variable
    settings, _ = configs_from_args(build_parser().parse_args(["serve"]))
    ring = KeyRing.load(settings.api_key, settings.api_keys_file)
    assert ring.tenant("Bearer secret-1") == "team-a"


def test_no_api_key_by_default() -> None:
    manifests = render()
    assert "Secret" not in kinds(manifests)
    env = env_of(server_container(manifests))
    assert "PAGEDSERVE_API_KEY" not in env and "PAGEDSERVE_API_KEYS_FILE" not in env


def test_responses_stored_on_a_created_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.cli import build_parser, configs_from_args

    manifests = render(
        {"responses": {"persistence": {"enabled": True}}, "server": {"responsesTtl": 3600}}
    )
    claim = the(manifests, "PersistentVolumeClaim")
    pod = the(manifests, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "responses")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    container = server_container(manifests)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "responses")
    assert mount == {"name": "responses", "mountPath": "/var/lib/pagedserve"}
    env = env_of(container)
    assert env["PAGEDSERVE_RESPONSES_STORE"] == "sqlite:/var/lib/pagedserve/responses.db"
    for name in ("PAGEDSERVE_RESPONSES_STORE", "PAGEDSERVE_RESPONSES_TTL"):
        monkeypatch.setenv(name, env[name])  # as the pod's environment sets them
    settings, _ = configs_from_args(build_parser().parse_args(["serve"]))
    assert settings.responses_store == "sqlite:/var/lib/pagedserve/responses.db"
    assert settings.responses_ttl == 3600


def test_responses_shared_in_redis_from_a_secret() -> None:
    manifests = render({"responses": {"redis": {"existingSecret": "redis-url"}}, "replicaCount": 3})
    ref = env_of(server_container(manifests))["PAGEDSERVE_RESPONSES_STORE"]["secretKeyRef"]
    assert ref == {"name": "redis-url", "key": "url"}
    assert "PersistentVolumeClaim" not in kinds(manifests)


def test_responses_in_the_pods_cache_by_default() -> None:
    assert "PAGEDSERVE_RESPONSES_STORE" not in env_of(server_container(render()))


def model_volume(manifests: list[dict[str, Any]]) -> dict[str, Any] | None:
    volumes = the(manifests, "Deployment")["spec"]["template"]["spec"]["volumes"]
    return next((v for v in volumes if v["name"] == "model"), None)


def test_model_baked_into_the_image_by_default() -> None:
    manifests = render()
    assert "PAGEDSERVE_MODEL" not in env_of(server_container(manifests))
    assert model_volume(manifests) is None
    assert "PersistentVolumeClaim" not in kinds(manifests)


def test_model_from_a_created_claim() -> None:
    manifests = render({"model": {"source": "pvc", "path": "Llama-3.1-8B-Instruct"}})
    claim = the(manifests, "PersistentVolumeClaim")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    volume = model_volume(manifests)
    assert volume is not None
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    container = server_container(manifests)
    assert env_of(container)["PAGEDSERVE_MODEL"] == "/models/Llama-3.1-8B-Instruct"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_model_from_an_existing_claim() -> None:
    manifests = render({"model": {"source": "pvc", "pvc": {"existingClaim": "weights"}}})
    assert "PersistentVolumeClaim" not in kinds(manifests)
    volume = model_volume(manifests)
    assert volume is not None and volume["persistentVolumeClaim"]["claimName"] == "weights"
    assert env_of(server_container(manifests))["PAGEDSERVE_MODEL"] == "/models"


def test_model_from_a_host_path() -> None:
    values = {"model": {"source": "hostPath", "path": "qwen", "hostPath": {"path": "/mnt/llm"}}}
    manifests = render(values)
    volume = model_volume(manifests)
    assert volume is not None and volume["hostPath"]["path"] == "/mnt/llm"
    assert env_of(server_container(manifests))["PAGEDSERVE_MODEL"] == "/models/qwen"


# --- LoRA adapters -----------------------------------------------------------------------------


def lora_modules(container: dict[str, Any]) -> dict[str, str]:
    """--lora-modules as the server reads its variable: adapter name -> directory."""
    raw = env_of(container)["PAGEDSERVE_LORA_MODULES"]
    return dict(module.split("=", 1) for module in raw.split(","))


def volume_at(manifests: list[dict[str, Any]], directory: str) -> tuple[dict, dict]:
    """(mount, volume) of the deepest mount that holds `directory` in the server's pod."""
    pod = the(manifests, "Deployment")["spec"]["template"]["spec"]
    holding = [
        m
        for m in server_container(manifests)["volumeMounts"]
        if (directory + "/").startswith(m["mountPath"].rstrip("/") + "/")
    ]
    mount = max(holding, key=lambda m: len(m["mountPath"]))
    return mount, next(v for v in pod["volumes"] if v["name"] == mount["name"])


def test_lora_adapters_from_an_existing_claim() -> None:
    manifests = render(VARIANTS["lora-from-a-claim-behind-a-pool"])
    container = server_container(manifests)
    env = env_of(container)
    assert env["PAGEDSERVE_ENABLE_LORA"] == "true"
    assert env["PAGEDSERVE_MAX_LORAS"] == "4"
    # Unset counts are left to the server's defaults.
    assert "PAGEDSERVE_MAX_LORA_RANK" not in env and "PAGEDSERVE_MAX_CPU_LORAS" not in env
    # An adapter's directory is its path, else its name, under the mount.
    assert lora_modules(container) == {"sql": "/adapters/sql-lora", "chat": "/adapters/chat"}
    for directory in lora_modules(container).values():
        mount, volume = volume_at(manifests, directory)
        assert mount == {
            "name": "lora-adapters",
            "mountPath": "/adapters",
            "subPath": "llama",
            "readOnly": True,
        }
        assert volume["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    # The chart creates no claim for adapters: they are copied onto one the user owns.
    assert "PersistentVolumeClaim" not in kinds(manifests)


def test_lora_adapters_from_config_maps() -> None:
    manifests = render(VARIANTS["lora-from-config-maps"])
    container = server_container(manifests)
    assert env_of(container)["PAGEDSERVE_ENABLE_LORA"] == "true"
    modules = lora_modules(container)
    assert modules == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    config_maps = {}
    for name, directory in modules.items():
        mount, volume = volume_at(manifests, directory)
        assert mount["mountPath"] == directory and mount["readOnly"] is True
        assert "subPath" not in mount  # a subPath mount would never see an updated ConfigMap
        config_maps[name] = volume["configMap"]["name"]
    assert config_maps == {"sql": "sql-lora", "chat": "chat-lora"}


def test_lora_adapters_on_the_model_claim_share_its_volume() -> None:
    values = {
        "model": {"source": "pvc", "path": "llama", "pvc": {"existingClaim": "weights"}},
        "lora": CLAIM
        | {"pvc": {"existingClaim": "weights", "subPath": "adapters/llama"}}
        | {"adapters": [{"name": "sql"}]},
    }
    manifests = render(values)
    pod = the(manifests, "Deployment")["spec"]["template"]["spec"]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["weights"]
    mount, volume = volume_at(manifests, lora_modules(server_container(manifests))["sql"])
    assert volume["name"] == "model"
    assert (mount["mountPath"], mount["subPath"], mount["readOnly"]) == (
        "/adapters",
        "adapters/llama",
        True,
    )
    assert env_of(server_container(manifests))["PAGEDSERVE_MODEL"] == "/models/llama"


def test_lora_without_adapters_only_turns_it_on() -> None:
    """Adapters can all come at run time (POST /v1/load_lora_adapter) from the claim, or
    from wherever the operator mounted them with extraVolumes."""
    counts = {"maxLoras": 8, "maxLoraRank": 64, "maxCpuLoras": 16}
    for lora in ({"enabled": True}, CLAIM):
        manifests = render({"lora": lora | counts})
        env = env_of(server_container(manifests))
        assert env["PAGEDSERVE_ENABLE_LORA"] == "true"
        assert "PAGEDSERVE_LORA_MODULES" not in env
        assert (
            env["PAGEDSERVE_MAX_LORAS"],
            env["PAGEDSERVE_MAX_LORA_RANK"],
            env["PAGEDSERVE_MAX_CPU_LORAS"],
        ) == ("8", "64", "16")
    # One CPU slot is enough for the server's default of one adapter per batch.
    assert render({"lora": {"enabled": True, "maxCpuLoras": 1}})


def test_no_lora_by_default() -> None:
    manifests = render()
    assert not [name for name in env_of(server_container(manifests)) if "LORA" in name]
    pod = the(manifests, "Deployment")["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if v["name"].startswith("lora")]


def test_the_server_reads_the_lora_variables_the_chart_sets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chart's LoRA variables are flags `pagedserve serve` reads, and its module list
    parses into the adapters listed."""
    from engine.lora import parse_lora_modules
    from server.cli import build_parser, engine_options, env_name

    env = env_of(server_container(render(VARIANTS["lora-from-a-claim-behind-a-pool"])))
    chart = {name: value for name, value in env.items() if "LORA" in name}
    known = {env_name(option.name) for option in engine_options()}
    assert chart.keys() <= known
    for name, value in chart.items():
        monkeypatch.setenv(name, value)  # as the pod's environment sets them
    args = build_parser().parse_args(["serve"])
    assert args.enable_lora is True and args.max_loras == 4
    modules = parse_lora_modules(args.lora_modules)
    assert [(m.name, m.path) for m in modules] == [
        ("sql", "/adapters/sql-lora"),
        ("chat", "/adapters/chat"),
    ]


def test_gpu_request_adds_the_device_limit_and_the_gpu_image() -> None:
    container = server_container(render({"gpu": {"count": 2}}))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["limits"]["memory"] == "4Gi"  # the other limits stay
    assert container["image"] == "pagedserve:0.1.0-gpu"


def test_cpu_pod_requests_no_gpu() -> None:
    container = server_container(render())
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert container["image"] == "pagedserve:0.1.0-cpu"


def test_no_service_links_in_the_server_environment() -> None:
    """A Service named "pagedserve" would otherwise inject PAGEDSERVE_PORT=tcp://..."""
    pod = the(render(), "Deployment")["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False


def test_pod_runs_unprivileged_on_a_read_only_root() -> None:
    manifests = render()
    pod = the(manifests, "Deployment")["spec"]["template"]["spec"]
    container = server_container(manifests)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # What the server must write to is an emptyDir; /dev/shm is memory-backed.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in mounts["/tmp"]
    assert "emptyDir" in mounts["/home/pagedserve/.cache"]


# --- Around the pod -------------------------------------------------------------------------


Selection = tuple[str, dict[str, str], dict[str, str]]


def selected_labels(manifests: list[dict[str, Any]]) -> list[Selection]:
    """(kind, selector, labels of what it selects) for each selector in a release."""
    deployment, service = the(manifests, "Deployment"), the(manifests, "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    return [
        ("Deployment", deployment["spec"]["selector"]["matchLabels"], pod_labels),
        ("Service", service["spec"]["selector"], pod_labels),
        (
            "PodDisruptionBudget",
            the(manifests, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
            pod_labels,
        ),
        (
            "ServiceMonitor",
            the(manifests, "ServiceMonitor")["spec"]["selector"]["matchLabels"],
            service["metadata"]["labels"],
        ),
    ]


def test_two_releases_in_one_namespace_share_no_selector_or_name() -> None:
    values = VARIANTS["everything-with-keda"]
    alpha, beta = render(values, release="alpha"), render(values, release="beta")
    for own, other in [(alpha, beta), (beta, alpha)]:
        for (kind, selector, own_labels), (_, _, other_labels) in zip(
            selected_labels(own), selected_labels(other), strict=True
        ):
            assert matches(selector, own_labels), kind
            assert not matches(selector, other_labels), kind
    alpha_names = {(m["kind"], m["metadata"]["name"]) for m in alpha}
    beta_names = {(m["kind"], m["metadata"]["name"]) for m in beta}
    assert alpha_names.isdisjoint(beta_names)


def test_helm_test_pod_is_not_behind_the_service() -> None:
    manifests = render()
    test_pod = the(manifests, "Pod")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    service_selector = the(manifests, "Service")["spec"]["selector"]
    assert not matches(service_selector, test_pod["metadata"]["labels"])


class _ModelsStub(http.server.BaseHTTPRequestHandler):
    """Answers /v1/models with `models`; records the Authorization header it got."""

    models: ClassVar[list[str]] = []
    authorization: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        self.authorization.append(self.headers.get("Authorization"))
        body = json.dumps({"object": "list", "data": [{"id": m} for m in self.models]})
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.parametrize(("models", "passes"), [(["smol"], True), ([], False)])
def test_helm_test_pod_checks_the_model_list(models: list[str], passes: bool) -> None:
    """The `helm test` pod's script, run here against a stand-in server."""
    container = the(render({"apiKey": {"value": "k"}}), "Pod")["spec"]["containers"][0]
    assert container["command"][:2] == ["python", "-c"]
    handler = type("Handler", (_ModelsStub,), {"models": models, "authorization": []})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        env = {
            "MODELS_URL": f"http://127.0.0.1:{server.server_address[1]}/v1/models",
            "API_KEY": "k",
        }
        try:
            result = subprocess.run(
                [sys.executable, "-c", container["command"][2]], env=env, timeout=30
            )
        finally:
            server.shutdown()
    assert (result.returncode == 0) == passes
    assert handler.authorization == ["Bearer k"]
    assert {e["name"] for e in container["env"]} == {"MODELS_URL", "API_KEY"}


def test_autoscaler_owns_the_replica_count() -> None:
    manifests = render({"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6}})
    deployment, hpa = the(manifests, "Deployment"), the(manifests, "HorizontalPodAutoscaler")
    assert "replicas" not in deployment["spec"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert the(render({"replicaCount": 3}), "Deployment")["spec"]["replicas"] == 3


def test_keda_scales_on_waiting_requests_of_this_release() -> None:
    manifests = render({"keda": {"enabled": True, "prometheus": PROMETHEUS}}, release="alpha")
    deployment, scaled = the(manifests, "Deployment"), the(manifests, "ScaledObject")
    assert "replicas" not in deployment["spec"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["serverAddress"] == PROMETHEUS["serverAddress"]
    query = trigger["metadata"]["query"]
    assert "vllm:num_requests_waiting" in query
    assert f'service="{the(manifests, "Service")["metadata"]["name"]}"' in query
    assert 'namespace="llm"' in query


def test_pod_disruption_budget_never_blocks_a_single_replica() -> None:
    budget = the(render(), "PodDisruptionBudget")["spec"]
    assert budget == {"maxUnavailable": 1, "selector": budget["selector"]}


def test_dashboard_and_rules_come_from_deploy() -> None:
    manifests = render({"grafanaDashboard": {"enabled": True}, "prometheusRule": {"enabled": True}})
    dashboard = the(manifests, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard_json = LINKED_FILES["files/grafana/pagedserve.json"].read_text()
    assert json.loads(dashboard["data"]["pagedserve.json"]) == json.loads(dashboard_json)
    rules_file = LINKED_FILES["files/prometheus/alerts.yaml"]
    rules = the(manifests, "PrometheusRule")["spec"]["groups"]
    assert rules == yaml.safe_load(rules_file.read_text())["groups"]


@pytest.mark.parametrize("link", LINKED_FILES)
def test_chart_links_to_the_deploy_artifacts(link: str) -> None:
    path = CHART / link
    assert path.is_symlink(), f"{link} must be a symlink, not a copy"
    assert path.resolve() == LINKED_FILES[link].resolve()


def test_packaged_chart_carries_the_linked_content(tmp_path: Path) -> None:
    """`helm package` stores what the links point to, so a chart archive stands alone."""
    archive = helm.package(CHART, destination=tmp_path)
    with helm.Chart.load(archive) as packaged:
        files = {f["name"]: f["data"] for f in packaged.files}
        values = VARIANTS["everything-with-keda"]
        from_archive = packaged.render(values, name="demo", namespace="llm")
    for link, source in LINKED_FILES.items():
        assert files[link] == source.read_text()
    with helm.Chart.load(CHART) as chart:
        assert from_archive == chart.render(values, name="demo", namespace="llm")


def test_notes_explain_how_to_reach_the_server() -> None:
    with helm.Chart.load(CHART) as chart:
        notes = chart.render({}, name="demo", namespace="llm")["pagedserve/templates/NOTES.txt"]
    assert "port-forward service/demo-pagedserve 8000:8000" in notes
    assert "/v1/chat/completions" in notes


# --- Gateway API Inference Extension, llm-d ---------------------------------------------------

POOL = {"inferencePool": {"enabled": True}, "kvEvents": {"enabled": True}}


def pod_labels(manifests: list[dict[str, Any]]) -> dict[str, str]:
    return the(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]


def test_inference_pool_selects_exactly_its_release() -> None:
    alpha, beta = render(POOL, release="alpha"), render(POOL, release="beta")
    for own, other in [(alpha, beta), (beta, alpha)]:
        pool = the(own, "InferencePool")
        INFERENCE_POOL_CRD.validate(pool)
        selector = pool["spec"]["selector"]["matchLabels"]
        assert matches(selector, pod_labels(own))
        assert not matches(selector, pod_labels(other))
        # Exactly the Deployment's pods: the same selector, not a looser one.
        assert selector == the(own, "Deployment")["spec"]["selector"]["matchLabels"]
        assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert (
        the(alpha, "InferencePool")["metadata"]["name"]
        != the(beta, "InferencePool")["metadata"]["name"]
    )


def test_inference_pool_points_at_the_endpoint_picker() -> None:
    pool = the(render(POOL, release="alpha"), "InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "alpha-pagedserve-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    values = {"inferencePool": {"enabled": True, "endpointPicker": {"serviceName": "epp"}}}
    assert the(render(values), "InferencePool")["spec"]["endpointPickerRef"]["name"] == "epp"
    assert "InferencePool" not in kinds(render())


def test_pods_carry_the_engine_type_the_epp_reads() -> None:
    labels = pod_labels(render(POOL))
    assert labels["llm-d.ai/engine-type"] == "vllm"
    assert labels["inference.networking.k8s.io/engine-type"] == "vllm"
    assert "llm-d.ai/engine-type" not in pod_labels(render())


def assert_rejects_each(
    crd: CustomResourceDefinition, good: dict[str, Any], broken: dict[str, Any]
) -> None:
    """`crd` rejects `good` after each of the `broken` damages to its spec."""
    for name, damage in broken.items():
        manifest = yaml.safe_load(yaml.safe_dump(good))
        damage(manifest["spec"])
        with pytest.raises(CrdError):
            crd.validate(manifest)
            pytest.fail(f"{name} passed validation")


def test_the_crd_validator_has_teeth() -> None:
    """Schema (unknown and missing fields, ranges) and CEL rules both reject."""
    good = the(render(POOL), "InferencePool")
    INFERENCE_POOL_CRD.validate(good)
    broken = {
        "unknown field": lambda spec: spec.update(targetPort=[{"number": 8000}]),
        "no selector": lambda spec: spec.pop("selector"),
        "port out of range": lambda spec: spec.update(targetPorts=[{"number": 70000}]),
        "duplicate ports (CEL)": lambda spec: spec.update(
            targetPorts=[{"number": 8000}, {"number": 8000}]
        ),
        "Service without a port (CEL)": lambda spec: spec["endpointPickerRef"].pop("port"),
        "unknown failure mode": lambda spec: spec["endpointPickerRef"].update(failureMode="Open"),
    }
    assert_rejects_each(INFERENCE_POOL_CRD, good, broken)


def test_kv_events_are_published_where_the_indexer_looks() -> None:
    """vLLM's --kv-events-config, bound on the pod's kv-events port, with llm-d's topic
    kv@<pod IP>@<model>; the server parses it."""
    from engine.kv_events import KVEventsConfig

    container = server_container(render({**POOL, "server": {"servedModelName": "llama"}}))
    names = [e["name"] for e in container["env"]]
    assert names.index("POD_IP") < names.index("PAGEDSERVE_KV_EVENTS_CONFIG")
    env = env_of(container)
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    raw = env["PAGEDSERVE_KV_EVENTS_CONFIG"].replace("$(POD_IP)", "10.1.2.3")
    config = KVEventsConfig.from_json(raw)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.enabled and config.endpoint == f"tcp://*:{ports['kv-events']}"
    assert config.replay_endpoint == f"tcp://*:{ports['kv-replay']}" == "tcp://*:5558"
    assert config.topic == "kv@10.1.2.3@llama"
    # Without a served name, the name the server derives: the model directory's, or the
    # bundled model's.
    pvc = {**POOL, "model": {"source": "pvc", "path": "Llama-3.1-8B-Instruct"}}
    pvc_env = env_of(server_container(render(pvc)))["PAGEDSERVE_KV_EVENTS_CONFIG"]
    assert json.loads(pvc_env)["topic"] == "kv@$(POD_IP)@Llama-3.1-8B-Instruct"
    default_env = env_of(server_container(render(POOL)))["PAGEDSERVE_KV_EVENTS_CONFIG"]
    assert json.loads(default_env)["topic"] == "kv@$(POD_IP)@SmolLM2-135M-Instruct"
    assert "PAGEDSERVE_KV_EVENTS_CONFIG" not in env_of(server_container(render()))


@pytest.mark.parametrize(("gpus", "ranks", "limit"), [(1, 4, 4), (1, None, 1), (0, 2, None)])
def test_gpu_count_follows_the_tensor_parallel_size(
    gpus: int, ranks: int | None, limit: int | None
) -> None:
    values = {"gpu": {"count": gpus}, "server": {"tensorParallelSize": ranks}}
    limits = server_container(render(values))["resources"]["limits"]
    assert limits.get("nvidia.com/gpu") == limit


def test_gpu_count_and_tensor_parallel_size_must_agree() -> None:
    with pytest.raises(helm.HelmRenderError, match="disagree"):
        render({"gpu": {"count": 2}, "server": {"tensorParallelSize": 4}})


# --- Gateway -> HTTPRoute -> InferencePool -> endpoint picker -------------------------------

ROUTE = {"inferencePool": {"enabled": True, "httpRoute": {"enabled": True}}}


def test_http_route_renders_only_when_enabled() -> None:
    assert "HTTPRoute" not in kinds(render())
    assert "HTTPRoute" not in kinds(render(POOL))
    assert "HTTPRoute" in kinds(render(ROUTE))
    with pytest.raises(helm.HelmRenderError, match=r"needs inferencePool\.enabled"):
        render({"inferencePool": {"httpRoute": {"enabled": True}}})


def test_http_route_sends_the_gateway_to_this_release_pool() -> None:
    values = {
        "inferencePool": {
            "enabled": True,
            "httpRoute": {
                "enabled": True,
                "gateway": {"name": "edge", "namespace": "gateways"},
                "hostnames": ["llm.example.com"],
                "requestTimeout": "10m",
            },
        }
    }
    alpha, beta = render(values, release="alpha"), render(values, release="beta")
    for own, other in [(alpha, beta), (beta, alpha)]:
        route = the(own, "HTTPRoute")
        HTTP_ROUTE_CRD.validate(route)
        (rule,) = route["spec"]["rules"]
        assert rule["backendRefs"] == [
            {
                "group": "inference.networking.k8s.io",
                "kind": "InferencePool",
                "name": the(own, "InferencePool")["metadata"]["name"],
            }
        ]
        assert rule["backendRefs"][0]["name"] != the(other, "InferencePool")["metadata"]["name"]
        assert rule["timeouts"] == {"request": "10m"}
    route = the(alpha, "HTTPRoute")["spec"]
    assert route["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "edge",
            "namespace": "gateways",
        }
    ]
    assert route["hostnames"] == ["llm.example.com"]
    # Without a namespace the Gateway is looked up in the route's own.
    assert "namespace" not in the(render(ROUTE), "HTTPRoute")["spec"]["parentRefs"][0]


def test_the_http_route_validator_has_teeth() -> None:
    good = the(render(ROUTE), "HTTPRoute")
    HTTP_ROUTE_CRD.validate(good)
    broken = {
        "unknown field": lambda spec: spec["rules"][0].update(backendRef={}),
        "timeout in words": lambda spec: spec["rules"][0]["timeouts"].update(request="5 min"),
        "backend timeout over the request's (CEL)": lambda spec: spec["rules"][0][
            "timeouts"
        ].update(backendRequest="1h"),
        "relative path (CEL)": lambda spec: spec["rules"][0]["matches"][0]["path"].update(
            value="v1"
        ),
        "no parent name": lambda spec: spec["parentRefs"][0].pop("name"),
    }
    assert_rejects_each(HTTP_ROUTE_CRD, good, broken)


def epp_pod_labels(manifests: list[dict[str, Any]]) -> dict[str, str]:
    return the(manifests, "Deployment", epp=True)["spec"]["template"]["metadata"]["labels"]


def test_endpoint_picker_and_server_select_only_their_own_pods() -> None:
    manifests = render(POOL)
    server_pods, epp_pods = pod_labels(manifests), epp_pod_labels(manifests)
    epp_deployment, epp_service = (
        the(manifests, "Deployment", epp=True),
        the(manifests, "Service", epp=True),
    )
    for selector in (
        epp_deployment["spec"]["selector"]["matchLabels"],
        epp_service["spec"]["selector"],
    ):
        assert matches(selector, epp_pods)
        assert not matches(selector, server_pods)
    server_selectors = {
        "Deployment": the(manifests, "Deployment")["spec"]["selector"]["matchLabels"],
        "Service": the(manifests, "Service")["spec"]["selector"],
        "PodDisruptionBudget": the(manifests, "PodDisruptionBudget")["spec"]["selector"][
            "matchLabels"
        ],
        "InferencePool": the(manifests, "InferencePool")["spec"]["selector"]["matchLabels"],
    }
    for kind, selector in server_selectors.items():
        assert matches(selector, server_pods), kind
        assert not matches(selector, epp_pods), kind
    # The ServiceMonitor scrapes the server's Service, never the picker's.
    monitored = render({**POOL, "serviceMonitor": {"enabled": True}})
    monitor = the(monitored, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert matches(monitor, the(monitored, "Service")["metadata"]["labels"])
    assert not matches(monitor, the(monitored, "Service", epp=True)["metadata"]["labels"])


def test_two_releases_endpoint_pickers_do_not_overlap() -> None:
    alpha, beta = render(POOL, release="alpha"), render(POOL, release="beta")
    for own, other in [(alpha, beta), (beta, alpha)]:
        selector = the(own, "Deployment", epp=True)["spec"]["selector"]["matchLabels"]
        assert not matches(selector, epp_pod_labels(other))
        assert not matches(the(own, "Service", epp=True)["spec"]["selector"], epp_pod_labels(other))
    names = [{(m["kind"], m["metadata"]["name"]) for m in r if is_epp(m)} for r in (alpha, beta)]
    assert names[0] and names[0].isdisjoint(names[1])


def epp_args(manifests: list[dict[str, Any]]) -> dict[str, str | None]:
    """The picker's flags: --name value pairs, and --name=value or a bare --name."""
    (container,) = the(manifests, "Deployment", epp=True)["spec"]["template"]["spec"]["containers"]
    args, flags = container["args"], {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            follows = args[i + 1] if i + 1 < len(args) else None
            bare = value or (follows if follows and not follows.startswith("--") else None)
            flags[name] = bare
    return flags


def test_endpoint_picker_serves_this_release_pool() -> None:
    manifests = render(POOL, release="alpha", namespace="llm")
    pool, service = the(manifests, "InferencePool"), the(manifests, "Service", epp=True)
    deployment = the(manifests, "Deployment", epp=True)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    flags = epp_args(manifests)
    assert flags["--pool-name"] == pool["metadata"]["name"]
    assert flags["--pool-namespace"] == "llm"
    assert flags["--pool-group"] == pool["apiVersion"].split("/")[0]
    # The pool's endpointPickerRef reaches the container's gRPC (ext-proc) port.
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[port["targetPort"]] == int(flags["--grpc-port"] or 0)
    for probe in (container["livenessProbe"], container["readinessProbe"]):
        assert probe["grpc"] == {
            "port": int(flags["--grpc-health-port"] or 0),
            "service": "inference-extension",
        }
    # The config file is the ConfigMap's key, mounted where --config-file reads it.
    mount = next(
        m for m in container["volumeMounts"] if flags["--config-file"].startswith(m["mountPath"])
    )
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = the(manifests, "ConfigMap", epp=True)
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert flags["--config-file"].removeprefix(mount["mountPath"] + "/") in config_map["data"]
    assert (
        pod["serviceAccountName"] == the(manifests, "ServiceAccount", epp=True)["metadata"]["name"]
    )
    assert "--ha-enable-leader-election" not in flags


def test_endpoint_picker_may_read_what_it_watches() -> None:
    manifests = render(VARIANTS["inference-pool-with-two-pickers"])
    rules = the(manifests, "Role", epp=True)["rules"]
    granted = {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    for group, resource in [("", "pods"), ("inference.networking.k8s.io", "inferencepools")]:
        assert {(group, resource, v) for v in ("get", "list", "watch")} <= granted
    binding = the(manifests, "RoleBinding", epp=True)
    assert binding["roleRef"]["name"] == the(manifests, "Role", epp=True)["metadata"]["name"]
    assert (
        binding["subjects"][0]["name"]
        == the(manifests, "ServiceAccount", epp=True)["metadata"]["name"]
    )
    # Two replicas elect a leader: a Lease, and probes that tell the leader apart.
    assert "--ha-enable-leader-election" in epp_args(manifests)
    assert ("coordination.k8s.io", "leases", "update") in granted
    (container,) = the(manifests, "Deployment", epp=True)["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["grpc"]["service"] == "readiness"
    assert container["livenessProbe"]["grpc"]["service"] == "liveness"
    single = the(render(POOL), "Role", epp=True)["rules"]
    assert not any("coordination.k8s.io" in rule["apiGroups"] for rule in single)


def test_bring_your_own_endpoint_picker() -> None:
    values = {
        "inferencePool": {
            "enabled": True,
            "endpointPicker": {"deploy": False, "serviceName": "shared-epp"},
        }
    }
    manifests = render(values)
    assert not [m for m in manifests if is_epp(m)]
    assert the(manifests, "InferencePool")["spec"]["endpointPickerRef"]["name"] == "shared-epp"
    assert not [m for m in render() if is_epp(m)]


def epp_config(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    config_map = the(manifests, "ConfigMap", epp=True)
    (text,) = config_map["data"].values()
    return yaml.safe_load(text)


def plugins(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Plugin name (its type unless named) -> its parameters."""
    return {p.get("name", p["type"]): p.get("parameters", {}) for p in config["plugins"]}


def references(config: dict[str, Any]) -> set[str]:
    refs = {p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    for source in config.get("dataLayer", {}).get("sources", []):
        refs |= {source["pluginRef"]} | {e["pluginRef"] for e in source.get("extractors", [])}
    return refs


PRECISE = {"token-producer", "precise-prefix-cache-producer", "endpoint-notification-source"}


@pytest.mark.parametrize("block_size", [None, 64])
def test_kv_events_turn_on_precise_prefix_routing(block_size: int | None) -> None:
    from engine.config import EngineArgs

    values = {
        **POOL,
        "kvEvents": {"enabled": True, "port": 6001},
        "server": {"servedModelName": "llama", "blockSize": block_size},
    }
    manifests = render(values, release="alpha", namespace="llm")
    config = epp_config(manifests)
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    declared = plugins(config)
    assert references(config) <= declared.keys()
    assert declared.keys() >= PRECISE
    producer = declared["precise-prefix-cache-producer"]
    ports = {p["name"]: p["containerPort"] for p in server_container(manifests)["ports"]}
    discovery = producer["kvEventsConfig"]["podDiscoveryConfig"]
    assert discovery["socketPort"] == ports["kv-events"] == 6001
    # A picker that starts (a rollout, a crash) rebuilds its index from each pod's replay.
    assert discovery["replaySocketPort"] == ports["kv-replay"] == 5558
    assert producer["kvEventsConfig"]["discoverPods"] is True
    # The topic the pods publish on (kv@<pod IP>@<model>) passes the subscriber's filter.
    topic = json.loads(env_of(server_container(manifests))["PAGEDSERVE_KV_EVENTS_CONFIG"])["topic"]
    assert topic.startswith(producer["kvEventsConfig"]["topicFilter"])
    chart_block_size = block_size or EngineArgs().block_size
    assert producer["tokenProcessorConfig"]["blockSize"] == chart_block_size
    scorer = declared["prefix-cache-scorer"]
    assert scorer["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    # Prompts are tokenized by the server itself, through its Service's render endpoints.
    service = the(manifests, "Service")
    tokens = declared["token-producer"]
    assert tokens["modelName"] == "llama"
    assert (
        tokens["vllm"]["url"]
        == f"http://{service['metadata']['name']}.llm.svc:{service['spec']['ports'][0]['port']}"
    )


def test_without_kv_events_prefix_routing_is_approximate() -> None:
    config = epp_config(render(POOL | {"kvEvents": {"enabled": False}}))
    declared = plugins(config)
    assert references(config) <= declared.keys()
    assert not PRECISE & declared.keys()
    assert declared["prefix-cache-scorer"] == {}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "max-score-picker"} <= declared.keys()


def weights(config: dict[str, Any]) -> dict[str, float]:
    """The default profile's scorers and their weights (the picker has none)."""
    (profile,) = config["schedulingProfiles"]
    return {p["pluginRef"]: p["weight"] for p in profile["plugins"] if "weight" in p}


@pytest.mark.parametrize("kv_events", [False, True])
def test_lora_turns_on_the_pickers_lora_affinity_scorer(kv_events: bool) -> None:
    """llm-d-router v0.10.0's lora-affinity-scorer (GIE's name too) takes no parameters; it
    reads vllm:lora_requests_info, which the core-metrics-extractor scrapes by default for
    pods of engine type vllm."""
    pool = {"inferencePool": {"enabled": True}, "kvEvents": {"enabled": kv_events}}
    manifests = render(pool | VARIANTS["lora-from-config-maps"])
    with_lora, without = epp_config(manifests), epp_config(render(pool))
    assert references(with_lora) <= plugins(with_lora).keys()
    scorer = {"lora-affinity-scorer": {}}
    assert plugins(with_lora) == plugins(without) | scorer
    assert weights(with_lora) == weights(without) | {"lora-affinity-scorer": 1}
    assert "lora-affinity-scorer" not in references(without)
    # The extractor keeps its built-in engine configs, vllm's LoRA metric among them, and
    # the pods say they are vllm.
    assert plugins(with_lora)["core-metrics-extractor"] == {}
    assert pod_labels(manifests)["llm-d.ai/engine-type"] == "vllm"


def test_endpoint_picker_restarts_when_its_config_changes() -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = the(render(values), "Deployment", epp=True)
        return deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    assert checksum(POOL) != checksum(POOL | {"kvEvents": {"enabled": False}})
    assert checksum(POOL) != checksum(POOL | {"lora": {"enabled": True}})


# --- Endpoint picker rollouts and crashes ---------------------------------------------------


def epp_budget(manifests: list[dict[str, Any]]) -> dict[str, Any] | None:
    budgets = [m for m in manifests if m["kind"] == "PodDisruptionBudget" and is_epp(m)]
    assert len(budgets) <= 1
    return budgets[0] if budgets else None


def serving_during_rollout(deployment: dict[str, Any]) -> int:
    """Replicas that still serve at the worst moment of a rollout: the Deployment keeps
    replicas - maxUnavailable Ready (standbys of a leader never are), Recreate none."""
    spec = deployment["spec"]
    if spec["strategy"]["type"] == "Recreate":
        return 0
    return spec["replicas"] - spec["strategy"]["rollingUpdate"]["maxUnavailable"]


def test_precise_pickers_all_serve_and_roll_one_by_one() -> None:
    """With KV events, two replicas that each serve (no leader election): a rolling update
    and a node drain (the PodDisruptionBudget) always leave one serving, and the Gateway
    routes around a picker that does not answer (FailOpen)."""
    manifests = render(POOL)
    deployment = the(manifests, "Deployment", epp=True)
    assert deployment["spec"]["replicas"] == 2
    assert "--ha-enable-leader-election" not in epp_args(manifests)
    assert serving_during_rollout(deployment) >= 1
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 1
    budget = epp_budget(manifests)
    assert budget is not None
    assert budget["spec"]["maxUnavailable"] == 1 < deployment["spec"]["replicas"]
    assert (
        budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    )
    assert not matches(budget["spec"]["selector"]["matchLabels"], pod_labels(manifests))
    pod = deployment["spec"]["template"]["spec"]
    spread = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert spread[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert matches(
        spread[0]["podAffinityTerm"]["labelSelector"]["matchLabels"], epp_pod_labels(manifests)
    )
    # Longer than llm-d-router v0.10.0's 30 s drain, which begins at SIGTERM.
    assert pod["terminationGracePeriodSeconds"] > 30
    assert the(manifests, "InferencePool")["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_an_approximate_picker_is_one_and_rolls_over_with_a_surge() -> None:
    """Without KV events the prefix index is one replica's routing history: one replica,
    whose successor is Ready before it stops; no budget could leave a single one serving."""
    manifests = render({"inferencePool": {"enabled": True}})
    deployment = the(manifests, "Deployment", epp=True)
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert serving_during_rollout(deployment) == 1
    assert epp_budget(manifests) is None
    assert "affinity" not in deployment["spec"]["template"]["spec"]


def test_approximate_pickers_elect_a_leader_and_are_replaced_at_once() -> None:
    """More than one without KV events: one leader serves, standbys are never Ready while
    it leads, so a rolling update could not replace it (Recreate), and a budget would
    forbid evicting it for good (none)."""
    manifests = render(VARIANTS["inference-pool-with-two-pickers"])
    deployment = the(manifests, "Deployment", epp=True)
    assert deployment["spec"]["replicas"] == 2
    assert "--ha-enable-leader-election" in epp_args(manifests)
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert epp_budget(manifests) is None


@pytest.mark.parametrize("replicas", [1, 3])
def test_the_picker_replica_count_can_be_set(replicas: int) -> None:
    manifests = render(
        POOL | {"inferencePool": {"enabled": True, "endpointPicker": {"replicas": replicas}}}
    )
    assert the(manifests, "Deployment", epp=True)["spec"]["replicas"] == replicas
    assert (epp_budget(manifests) is not None) == (replicas > 1)
    assert "--ha-enable-leader-election" not in epp_args(manifests)


def test_without_replay_the_picker_is_not_told_of_one() -> None:
    manifests = render(POOL | {"kvEvents": {"enabled": True, "replayPort": None}})
    ports = {p["name"] for p in server_container(manifests)["ports"]}
    assert "kv-replay" not in ports
    config = json.loads(env_of(server_container(manifests))["PAGEDSERVE_KV_EVENTS_CONFIG"])
    assert "replay_endpoint" not in config
    discovery = plugins(epp_config(manifests))["precise-prefix-cache-producer"]["kvEventsConfig"]
    assert "replaySocketPort" not in discovery["podDiscoveryConfig"]


# --- Tenants and precise routing -------------------------------------------------------------


def test_tenants_with_precise_routing_let_the_picker_render_without_a_key() -> None:
    """With API keys the server answers the picker's keyless render calls only from the
    networks renderAllowFrom lists; the chart passes them on as the server reads them."""
    from server.settings import ServerSettings

    manifests = render(VARIANTS["inference-pool-with-tenants"])
    raw = env_of(server_container(manifests))["PAGEDSERVE_RENDER_ALLOW_FROM"]
    assert ServerSettings(render_allow_from=raw.split(",")).render_allow_from == ["10.244.0.0/16"]
    # The picker tokenizes through the release's Service, which reaches that server.
    tokens = plugins(epp_config(manifests))["token-producer"]
    service = the(manifests, "Service")["metadata"]["name"]
    assert tokens["vllm"]["url"].startswith(f"http://{service}.")
    # Without kvEvents, or without the chart's picker, nothing renders: no list needed.
    keys = {"apiKey": {"value": "k"}}
    assert render({"inferencePool": {"enabled": True}} | keys)
    assert render(
        {"inferencePool": {"enabled": True, "endpointPicker": {"deploy": False}}}
        | {"kvEvents": {"enabled": True}}
        | keys
    )
