"""Fixtures of the real-container tests: a podman host, the image, the compose cluster.

These tests run with ``make test-containers`` (``PDSERVE_CONTAINER_TESTS=1``), which ``.ci/run``
calls after ``make test``; ``make test`` itself skips them. Where podman is missing and cannot be
installed (not root, no apt-get), they skip and say so.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from pdserve.supervisor import pick_free_ports

from . import podman_host
from .compose_cluster import LOOPBACK, SERVICES, STARTUP_TIMEOUT_S, ComposeCluster

log = logging.getLogger("containers")

ENABLE_ENV = "PDSERVE_CONTAINER_TESTS"
IMAGE = "localhost/pdserve:ci"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ENABLE_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"real containers run with `make test-containers` ({ENABLE_ENV}=1)")
    for item in items:
        if "tests/deploy/containers/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@dataclass
class Image:
    tag: str
    size_bytes: int
    build_s: float


@pytest.fixture(scope="session")
def image() -> Image:
    """The image of deploy/Dockerfile, built on the local Debian base (made once, then cached)."""
    try:
        podman_host.ensure_tools()
    except podman_host.Unavailable as why:
        pytest.skip(f"no container runtime: {why}")
    podman_host.ensure_ulimits()
    podman_host.ensure_runtime()
    base = podman_host.ensure_base_image()
    build_s = podman_host.build_image(IMAGE, base)
    size = podman_host.image_size_bytes(IMAGE)
    log.info("image %s: %.2f GB, built in %.0f s", IMAGE, size / 1e9, build_s)
    return Image(IMAGE, size, build_s)


@pytest.fixture(scope="module")
def cluster(image: Image, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeCluster]:
    """The compose cluster up and healthy: router, 2 prefill and 2 decode engines, in containers."""
    grpc_port, http_port, metrics_port = pick_free_ports(LOOPBACK, 3)
    api_key = f"sk-{secrets.token_hex(16)}"
    with podman_host.docker_api() as docker_host, podman_host.HealthcheckTimer():
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")},
            "DOCKER_HOST": docker_host,
            "COMPOSE_HTTP_TIMEOUT": "600",
            "PDSERVE_IMAGE": image.tag,
            "PDSERVE_CLUSTER_TOKEN": secrets.token_hex(16),
            "PDSERVE_API_KEYS": api_key,
            "PDSERVE_ROUTER_PORT": str(grpc_port),
            "PDSERVE_HTTP_PORT": str(http_port),
            "PDSERVE_ROUTER_METRICS_PORT": str(metrics_port),
        }
        ports = {"grpc": grpc_port, "http": http_port, "metrics": metrics_port}
        cluster = ComposeCluster(env=env, api_key=api_key, ports=ports)
        cluster.compose("down", "--volumes", "--remove-orphans", check=False)  # a previous run's leftovers
        started = time.monotonic()
        try:
            # Compose starts the router only once every engine's health check passes.
            cluster.compose("up", "-d", "--no-build", timeout=STARTUP_TIMEOUT_S + 60)
            cluster.wait_healthy(SERVICES)
            cluster.startup_s = time.monotonic() - started
            log.info("compose cluster healthy %.0f s after `up`", cluster.startup_s)
            yield cluster
        finally:
            logs = cluster.compose("logs", "--no-color", "--timestamps", check=False)
            log_file = tmp_path_factory.mktemp("compose") / "services.log"
            log_file.write_text(logs.stdout + logs.stderr)
            log.info("every service's log: %s", log_file)
            cluster.compose("down", "--volumes", "--remove-orphans", check=False)
