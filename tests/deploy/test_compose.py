"""deploy/docker-compose.yml, proven without containers.

``tests/deploy/containers/`` (``make test-containers``, run by CI after ``make test``) builds the image
and runs the file in real containers with podman. Here, in ``make test`` and on machines without
podman, the compose file is checked in two ways:

- Debian's ``docker-compose`` (installed by ``.ci/run``) validates it with ``config``, and refuses
  it when no cluster token is set.
- Its commands run as local processes, as ``docker compose up`` would start them: in dependency
  order, each waited for through its own compose ``healthcheck``, with the compose
  ``environment``. Each service name resolves to 127.0.0.1 and each (service, container port)
  gets its own free local port, because locally the five processes share the one network
  namespace that compose gives each container for itself. Then a prompt long enough to be
  disaggregated goes client -> router -> prefill -> tcp KV transfer -> decode -> client, and
  every target of deploy/prometheus.yml answers ``/metrics``.

That last test loads the bundled SmolLM2-135M in five processes: about 1-2 minutes on 2 cores.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from pdserve import healthcheck
from pdserve.client import Client
from pdserve.router.auth import load_api_keys
from pdserve.supervisor import SupervisedProcess, Supervisor, pick_free_ports
from tests.helpers.paths import DEPLOY

COMPOSE_FILE = DEPLOY / "docker-compose.yml"
PROMETHEUS_FILE = DEPLOY / "prometheus.yml"
# The only variable without a default in the compose file; every other one keeps its default.
VARIABLES = {"PDSERVE_CLUSTER_TOKEN": secrets.token_hex(16)}

LOOPBACK = "127.0.0.1"
PORT_FLAGS = ("--port", "--metrics-port", "--kv-port", "--http-port")
# Each wave of services (engines, then the router) gets this long to become healthy.
STARTUP_TIMEOUT_S = 240.0
HEALTH_POLL_S = 3.0
REQUEST_TIMEOUT_S = 120.0
# Above the router's --disagg-min-tokens (32), so it goes through a prefill engine.
LONG_PROMPT = (
    "Disaggregated serving runs the prompt on a prefill engine and the generation on a decode "
    "engine. The prefill engine computes the key and value cache of the prompt, and the decode "
    "engine pulls those blocks over the network before it generates the answer. In short,"
)


# ---------------------------------------------------------------------- compose file


def interpolate(value: Any, variables: dict[str, str]) -> Any:
    """Compose's variable substitution in every string value: ``${VAR}``, ``${VAR:-default}``,
    ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``, ``$VAR`` and ``$$``."""
    if isinstance(value, dict):
        return {key: interpolate(item, variables) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, variables) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match[0] == "$$":
            return "$"
        name, op, arg = match["name"] or match["bare"], match["op"] or "", match["arg"]
        missing = not variables.get(name) if op.startswith(":") else name not in variables
        if op.endswith("-") and missing:
            return arg
        if op.endswith("?") and missing:
            raise ValueError(f"{name}: {arg}")
        return variables.get(name, "")

    return re.sub(
        r"\$(?:\$|\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|(?P<bare>\w+))", substitute, value
    )


def load_compose(variables: dict[str, str] = VARIABLES) -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), variables)


def default_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services ``docker compose up`` starts: those in no profile."""
    return {name: svc for name, svc in compose["services"].items() if not svc.get("profiles")}


def start_waves(services: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Services grouped in start order: each wave once every service of the previous ones is healthy."""
    waves: list[list[str]] = []
    started: set[str] = set()
    while len(started) < len(services):
        wave = [
            n for n, svc in services.items() if n not in started and set(svc.get("depends_on", ())) <= started
        ]
        assert wave, f"depends_on cycle or unknown service among {sorted(set(services) - started)}"
        waves.append(wave)
        started.update(wave)
    return waves


def split_command(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(token) for token in command]


def healthcheck_command(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    if isinstance(test, str):
        return shlex.split(test)
    kind, *rest = test
    return shlex.split(rest[0]) if kind == "CMD-SHELL" else rest


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def local_environment(service: dict[str, Any], compose: dict[str, Any]) -> dict[str, str]:
    """The service's environment, with each secret it mounts (``/run/secrets/NAME``) read from its
    source file instead, as compose's bind mount of that file makes it appear in the container."""
    sources = {
        f"/run/secrets/{name}": str(DEPLOY / spec["file"])  # relative to the compose file
        for name, spec in (compose.get("secrets") or {}).items()
        if name in (service.get("secrets") or ())
    }
    return {key: sources.get(value, value) for key, value in environment(service).items()}


def duration_s(value: str) -> float:
    """A compose duration such as ``30s``, ``1m30s`` or ``500ms``, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---------------------------------------------------------------------- compose -> local processes


class PortMap:
    """A free local port for each (service, container port), picked when first asked for."""

    def __init__(self) -> None:
        self.local: dict[tuple[str, int], int] = {}  # {(service, container port): local port}

    def __call__(self, service: str, port: int) -> int:
        if (service, port) not in self.local:
            taken = set(self.local.values())
            while (free := pick_free_ports(LOOPBACK, 1)[0]) in taken:
                pass
            self.local[service, port] = free
        return self.local[service, port]


def local_argv(tokens: list[str], service: str, services: set[str], ports: PortMap) -> list[str]:
    """A container's command line as the same process on this machine.

    The values of ``--port``, ``--metrics-port`` and ``--kv-port`` are the service's own ports;
    ``--host 0.0.0.0`` and ``--advertise-host NAME`` become 127.0.0.1; each ``HOST:PORT`` whose host
    is a service (or the container's own loopback) becomes that service's local port.
    """

    def address(token: str) -> str:
        host, colon, port = token.rpartition(":")
        if not (colon and port.isdigit()) or host not in services | {LOOPBACK, "localhost"}:
            return token
        return f"{LOOPBACK}:{ports(host if host in services else service, int(port))}"

    argv = []
    for flag, token in zip([None, *tokens], tokens, strict=False):
        if flag in PORT_FLAGS:
            token = str(ports(service, int(token)))
        elif (flag == "--host" and token in ("0.0.0.0", "::")) or flag == "--advertise-host":
            token = LOOPBACK
        else:
            token = ",".join(address(part) for part in token.split(","))
        argv.append(token)
    # The image's console script and interpreter are this checkout's.
    programs = {"pdserve": [sys.executable, "-m", "pdserve"], "python": [sys.executable]}
    return [*programs.get(argv[0], argv[:1]), *argv[1:]]


class LocalService(SupervisedProcess):
    """One compose service run as a local process, healthy when its compose healthcheck passes."""

    def __init__(
        self, name: str, argv: list[str], health_argv: list[str], env: dict[str, str], log_path: Path
    ) -> None:
        super().__init__(name, argv, log_path, env=env)
        self.health_argv = health_argv

    def healthy(self) -> bool:
        """The compose healthcheck, run as a command, exits 0."""
        check = subprocess.run(self.health_argv, env=self.env, capture_output=True, timeout=30)
        return check.returncode == 0


def local_services(compose: dict[str, Any], ports: PortMap, log_dir: Path) -> dict[str, LocalService]:
    services = default_services(compose)
    names = set(services)
    return {
        name: LocalService(
            name=name,
            argv=local_argv(split_command(svc["command"]), name, names, ports),
            health_argv=local_argv(healthcheck_command(svc), name, names, ports),
            env={**os.environ, "PYTHONUNBUFFERED": "1", **local_environment(svc, compose)},
            log_path=log_dir / f"{name}.log",
        )
        for name, svc in services.items()
    }


@contextlib.contextmanager
def compose_up_locally(
    compose: dict[str, Any], log_dir: Path
) -> Iterator[tuple[dict[str, LocalService], PortMap]]:
    """Start the default services wave by wave, each wave healthy before the next; stop them all at exit
    (like ``docker stop``: SIGTERM, then SIGKILL after the wave's stop_grace_period), dependents
    first, as ``docker compose down`` does."""
    ports = PortMap()
    procs = local_services(compose, ports, log_dir)
    # Each health check is a process of its own: poll every few seconds, not every 0.2 s.
    with Supervisor(poll_s=HEALTH_POLL_S) as supervisor:
        for wave in start_waves(default_services(compose)):
            grace = max(duration_s(compose["services"][n].get("stop_grace_period", "10s")) for n in wave)
            supervisor.start(
                wave,
                lambda names: [procs[n] for n in names],
                timeout_s=STARTUP_TIMEOUT_S,
                retry_lost_port=False,  # the ports are fixed by PortMap
                grace_s=grace,
            )
        yield procs, ports


def container_port(service: dict[str, Any], flag: str) -> int:
    """The value of ``--port`` (or another port flag) in the service's command."""
    tokens = split_command(service["command"])
    return int(tokens[tokens.index(flag) + 1])


def metrics_targets(services: dict[str, dict[str, Any]]) -> set[str]:
    """``service:port`` of every process's /metrics, from the ``--metrics-port`` of its command."""
    return {f"{name}:{container_port(svc, '--metrics-port')}" for name, svc in services.items()}


def prometheus_targets() -> set[str]:
    config = yaml.safe_load(PROMETHEUS_FILE.read_text())
    return {
        target
        for job in config["scrape_configs"]
        for static in job.get("static_configs", ())
        for target in static["targets"]
    }


# ---------------------------------------------------------------------- tests


def _docker_compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (.ci/run installs Debian's docker-compose package)")
    return subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_FILE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_docker_compose_config_validates_the_file():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")} | VARIABLES
    result = _docker_compose("--profile", "monitoring", "config", env=env)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert set(resolved["services"]) == {
        "router",
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
        "prometheus",
    }
    assert (
        resolved["services"]["prefill-0"]["environment"]["PDSERVE_CLUSTER_TOKEN"]
        == VARIABLES["PDSERVE_CLUSTER_TOKEN"]
    )


def test_docker_compose_config_refuses_to_run_without_a_cluster_token():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    result = _docker_compose("config", env=env)
    assert result.returncode != 0
    assert "PDSERVE_CLUSTER_TOKEN" in result.stderr


def test_docker_compose_config_gives_the_router_keys_from_the_environment_or_a_secrets_file(tmp_path):
    key_file = tmp_path / "api-keys"
    key_file.write_text("sk-from-file\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")} | VARIABLES
    default = yaml.safe_load(_docker_compose("config", env=env).stdout)
    assert default["secrets"]["pdserve_api_keys"]["file"] == "/dev/null"
    env |= {"PDSERVE_API_KEYS": "sk-a,sk-b", "PDSERVE_API_KEYS_FILE": str(key_file)}
    result = _docker_compose("config", env=env)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    router = resolved["services"]["router"]
    assert router["environment"]["PDSERVE_API_KEYS"] == "sk-a,sk-b"
    assert router["environment"]["PDSERVE_API_KEYS_FILE"] == "/run/secrets/pdserve_api_keys"
    assert [s["source"] if isinstance(s, dict) else s for s in router["secrets"]] == ["pdserve_api_keys"]
    assert resolved["secrets"]["pdserve_api_keys"]["file"] == str(key_file)
    assert "PDSERVE_API_KEYS" not in resolved["services"]["prefill-0"]["environment"]  # engines need none


def test_router_environment_yields_the_keys_of_both_sources(tmp_path):
    key_file = tmp_path / "api-keys"
    key_file.write_text("# rotated monthly\nsk-from-file\n")
    compose = load_compose(
        {**VARIABLES, "PDSERVE_API_KEYS": "sk-env", "PDSERVE_API_KEYS_FILE": str(key_file)}
    )
    keys = load_api_keys(None, None, local_environment(compose["services"]["router"], compose))
    assert len(keys) == 2 and keys.accepts("sk-env") and keys.accepts("sk-from-file")
    compose = load_compose()  # neither: /dev/null, no key
    assert not load_api_keys(None, None, local_environment(compose["services"]["router"], compose))


def test_every_service_is_restarted_healthchecked_and_started_after_healthy_dependencies():
    compose = load_compose()
    for name, svc in compose["services"].items():
        assert svc.get("restart") == "unless-stopped", name
        assert healthcheck_command(svc), name
        for dependency, spec in (svc.get("depends_on") or {}).items():
            assert spec == {"condition": "service_healthy"}, (name, dependency)
    assert start_waves(default_services(compose)) == [
        ["prefill-0", "prefill-1", "decode-0", "decode-1"],
        ["router"],
    ]


def test_prometheus_scrapes_the_metrics_port_of_every_process():
    compose = load_compose()
    assert prometheus_targets() == metrics_targets(default_services(compose))
    prometheus = compose["services"]["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]


def test_interpolation_follows_compose_rules():
    variables = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} $SET $$SET", variables) == "x d  d x $SET"
    with pytest.raises(ValueError, match="UNSET: set it"):
        interpolate({"a": ["${UNSET:?set it}"]}, variables)


def test_local_argv_maps_service_names_and_ports_to_this_machine():
    ports = PortMap()
    argv = local_argv(
        shlex.split(
            "pdserve router --host 0.0.0.0 --port 50051 --prefill p-0:50051,p-1:50051 --decode d-0:50051"
        ),
        "router",
        {"router", "p-0", "p-1", "d-0"},
        ports,
    )
    local = {key: f"{LOOPBACK}:{port}" for key, port in ports.local.items()}
    assert argv == [
        sys.executable, "-m", "pdserve", "router", "--host", LOOPBACK, "--port", str(ports("router", 50051)),
        "--prefill", f"{local['p-0', 50051]},{local['p-1', 50051]}", "--decode", local["d-0", 50051],
    ]  # fmt: skip
    assert len(set(ports.local.values())) == 4
    health = local_argv(["python", "-m", "pdserve.healthcheck", "127.0.0.1:50051"], "router", set(), ports)
    assert health == [sys.executable, "-m", "pdserve.healthcheck", local["router", 50051]]


def test_healthcheck_exits_nonzero_when_nothing_serves():
    (port,) = pick_free_ports(LOOPBACK, 1)
    out = io.StringIO()
    with redirect_stdout(out):
        assert healthcheck.main([f"{LOOPBACK}:{port}", "--timeout", "1"]) == 1
    assert "UNAVAILABLE" in out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(2 * STARTUP_TIMEOUT_S + REQUEST_TIMEOUT_S + 180)
def test_compose_commands_serve_a_request_through_prefill_and_decode(tmp_path):
    key_file = tmp_path / "api-keys"
    key_file.write_text("sk-compose-test\n")
    compose = load_compose({**VARIABLES, "PDSERVE_API_KEYS_FILE": str(key_file)})
    with compose_up_locally(compose, tmp_path) as (procs, ports):
        router = f"{LOOPBACK}:{ports('router', container_port(compose['services']['router'], '--port'))}"
        with Client(router, api_key="sk-wrong") as client, pytest.raises(grpc.RpcError) as refused:
            client.generate(prompt="Hello", max_tokens=1, timeout=REQUEST_TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(router, api_key="sk-compose-test") as client:
            completion = client.generate(
                prompt=LONG_PROMPT, max_tokens=8, ignore_eos=True, timeout=REQUEST_TIMEOUT_S
            )
            engines = client.stats()
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == 8
        assert completion.text.strip()
        assert {e["role"] for e in engines} == {"prefill", "decode"} and len(engines) == 4
        # The prompt's KV crossed from a prefill engine to a decode engine (tcp, cluster token).
        assert sum(e["num_blocks_pulled"] for e in engines if e["role"] == "decode") > 0, engines
        for target in sorted(prometheus_targets()):
            service, port = target.split(":")
            url = f"http://{LOOPBACK}:{ports(service, int(port))}/metrics"
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert reply.status == 200 and b"pdserve_" in reply.read(), target
    for proc in procs.values():
        assert proc.popen.poll() is not None, f"{proc.name} still running"
    # Each process stops on SIGTERM within its stop_grace_period (exit 0), as `docker stop` needs.
    assert {p.name: p.popen.returncode for p in procs.values()} == dict.fromkeys(procs, 0)
