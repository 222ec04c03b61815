"""The Kubernetes manifests: they build with kustomize (base and GPU overlay), every object
validates against the API schema in strict mode, and they hold what the deployment relies on
(discovery through headless Services, drain-sized grace periods, probes, a Secret for the token,
locked-down containers, a NetworkPolicy, disruption budgets). Running their commands as local
processes under load is tests/router/test_discovery.py.
"""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest
import yaml

from pdserve.cli import build_parser
from tests.helpers import k8s_manifests

K8S_VERSION = "1.33.0"
ENGINES = ("pdserve-prefill", "pdserve-decode")
LEASE_S = 30  # the engines' default --lease-ms


@pytest.fixture(scope="module")
def docs():
    return k8s_manifests.build()


@pytest.fixture(scope="module")
def gpu_docs():
    return k8s_manifests.build(k8s_manifests.GPU_OVERLAY)


def _pod(docs, name):
    return k8s_manifests.find(docs, "Deployment", name)["spec"]["template"]["spec"]


def _arg(argv: list[str], flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(f"{flag}=")]
    return value


def test_base_and_gpu_overlay_build_the_expected_objects(docs, gpu_docs):
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted(
        [("Deployment", n) for n in ("pdserve-router", *ENGINES)]
        + [("Service", n) for n in ("pdserve-router", *ENGINES)]
        + [("PodDisruptionBudget", n) for n in ("pdserve-router", *ENGINES)]
        + [("NetworkPolicy", "pdserve-engines")]
    )
    assert sorted((d["kind"], d["metadata"]["name"]) for d in gpu_docs) == kinds
    for name in ENGINES:
        assert _pod(gpu_docs, name)["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "nvidia.com/gpu" not in _pod(docs, name)["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("variant", ["base", "gpu"])
def test_every_object_validates_against_the_api_schema_strictly(docs, gpu_docs, variant):
    for doc in docs if variant == "base" else gpu_docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_strict_validation_catches_an_unknown_field(docs):
    broken = copy.deepcopy(k8s_manifests.find(docs, "Deployment", "pdserve-decode"))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 50051}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_no_secret_is_written_in_a_manifest(docs):
    text = yaml.safe_dump_all(docs)
    assert not re.search(r"\b[0-9a-f]{32}\b", text)
    for name in ENGINES:
        (token,) = [
            e for e in _pod(docs, name)["containers"][0]["env"] if e["name"] == "PDSERVE_CLUSTER_TOKEN"
        ]
        assert "value" not in token
        assert token["valueFrom"]["secretKeyRef"] == {"name": "pdserve-cluster-token", "key": "token"}
    (keys,) = [
        e for e in _pod(docs, "pdserve-router")["containers"][0]["env"] if e["name"] == "PDSERVE_API_KEYS"
    ]
    assert "value" not in keys
    assert keys["valueFrom"]["secretKeyRef"] == {"name": "pdserve-api-keys", "key": "keys"}


def test_containers_are_locked_down_sized_and_probed_on_the_grpc_health_service(docs):
    for name in ("pdserve-router", *ENGINES):
        pod = _pod(docs, name)
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        (container,) = pod["containers"]
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
        assert security["capabilities"]["drop"] == ["ALL"]
        assert (
            {"cpu", "memory"}
            <= set(container["resources"]["requests"])
            <= set(container["resources"]["limits"])
        )
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": 50051}, (name, probe)
        # A read-only root needs a writable /tmp (the engine core's IPC sockets).
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_router_discovers_engines_through_their_headless_services(docs):
    argv = k8s_manifests.container_argv(docs, "pdserve-router")
    assert _arg(argv, "--prefill") == "dns:pdserve-prefill:50051"
    assert _arg(argv, "--decode") == "dns:pdserve-decode:50051"
    assert _arg(argv, "--http-port") == "8080"
    for name in ENGINES:
        service = k8s_manifests.find(docs, "Service", name)["spec"]
        assert service["clusterIP"] == "None" and service.get("publishNotReadyAddresses") is False
        deployment = k8s_manifests.find(docs, "Deployment", name)
        assert deployment["spec"]["replicas"] == 2
        assert service["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_grace_period_covers_prestop_and_a_drain_longer_than_the_lease(docs):
    for name in ENGINES:
        pod = _pod(docs, name)
        (container,) = pod["containers"]
        drain_s = float(_arg(k8s_manifests.container_argv(docs, name), "--drain-timeout"))
        pre_stop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert drain_s > LEASE_S
        assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + 5  # + gRPC shutdown grace


def test_only_the_router_reaches_engine_grpc_and_only_engines_their_kv_ports(docs):
    policy = k8s_manifests.find(docs, "NetworkPolicy", "pdserve-engines")["spec"]
    engine_labels = _pod_labels(docs, "pdserve-decode")
    assert policy["podSelector"]["matchLabels"].items() <= engine_labels.items()
    rules = policy["ingress"]
    # The gRPC port and the framed Session stream's (--session-port): the router's alone.
    for router_port in (50051, 50052):
        rules_of_port = [r for r in rules if any(p.get("port") == router_port for p in r["ports"])]
        assert len(rules_of_port) == 1, router_port
        selector = rules_of_port[0]["from"][0]["podSelector"]["matchLabels"]
        assert selector["app.kubernetes.io/component"] == "router"
        for rule in rules:
            for port in rule["ports"]:
                if "endPort" in port:  # engine-to-engine ranges skip the router's ports
                    assert not port["port"] <= router_port <= port["endPort"], port
    kv_rule = [r for r in rules if any(p.get("port", 0) <= 5600 <= p.get("endPort", 0) for p in r["ports"])]
    assert kv_rule and kv_rule[0]["from"][0]["podSelector"]["matchLabels"].items() <= engine_labels.items()


def _pod_labels(docs, name):
    return k8s_manifests.find(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


def test_every_role_has_a_disruption_budget(docs):
    for name in ("pdserve-router", *ENGINES):
        budget = k8s_manifests.find(docs, "PodDisruptionBudget", name)["spec"]
        assert budget["maxUnavailable"] == 1
        assert budget["selector"]["matchLabels"].items() <= _pod_labels(docs, name).items()


@pytest.mark.parametrize("name", ["pdserve-router", *ENGINES])
def test_container_command_lines_parse_with_pdserves_own_cli(docs, name):
    argv = k8s_manifests.container_argv(docs, name)
    argv = k8s_manifests.substitute(argv, {"POD_IP": "10.0.0.7", "POD_NAME": "pod-0"})
    args = build_parser().parse_args(argv)
    assert args.port == 50051
    if name != "pdserve-router":
        assert args.session_port == 50052  # the port the NetworkPolicy opens to the router
    if name == "pdserve-router":
        assert args.discovery_interval == 5.0
    else:
        assert args.advertise_host == "10.0.0.7" and args.engine_id == "pod-0" and args.drain_timeout == 45.0
