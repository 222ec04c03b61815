"""The compose cluster under test: its compose project, published ports, and containers by service."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

from tests.helpers.paths import DEPLOY

from . import podman_host

PROJECT = "pdserve-ci"
LOOPBACK = "127.0.0.1"
# Four engines load the model side by side on the machine's cores, then the router starts.
STARTUP_TIMEOUT_S = 420.0
ENGINES = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
SERVICES = [*ENGINES, "router"]


@dataclass
class ComposeCluster:
    """``deploy/docker-compose.yml`` up under one project name, driven through podman's Docker API."""

    env: dict[str, str]
    api_key: str
    ports: dict[str, int]  # {"grpc" | "http" | "metrics": published host port}
    startup_s: float = 0.0

    @property
    def router(self) -> str:
        return f"{LOOPBACK}:{self.ports['grpc']}"

    @property
    def http_base(self) -> str:
        return f"http://{LOOPBACK}:{self.ports['http']}/v1"

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        argv = [
            "docker-compose",
            "-p",
            PROJECT,
            "-f",
            str(DEPLOY / "docker-compose.yml"),
        ]
        return podman_host.run([*argv, *args], timeout=timeout, check=check, env=self.env)

    def container(self, service: str) -> str:
        """The name of the service's container (compose labels it with project and service)."""
        names = podman_host.podman(
            "ps", "-a", "--format", "{{.Names}}",
            "--filter", f"label=com.docker.compose.project={PROJECT}",
            "--filter", f"label=com.docker.compose.service={service}",
        ).stdout.split()  # fmt: skip
        assert len(names) == 1, f"{service}: containers {names}"
        return names[0]

    def inspect(self, service: str, template: str) -> str:
        return podman_host.podman("inspect", self.container(service), "--format", template).stdout.strip()

    def health(self, service: str) -> str:
        return self.inspect(service, "{{.State.Health.Status}}")

    def wait_healthy(self, services: list[str], timeout_s: float = STARTUP_TIMEOUT_S) -> float:
        """Seconds until every one of ``services`` reports healthy."""
        started = time.monotonic()
        while True:
            states = {service: self.health(service) for service in services}
            if all(state == "healthy" for state in states.values()):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"not healthy after {timeout_s:.0f} s: {states}")
            time.sleep(1.0)
