"""A container host made of podman on this machine, for the real-container tests.

No Docker engine runs here, nor in CI, but podman does: it runs the image built from
``deploy/Dockerfile``, and its ``system service`` speaks the Docker API, so Debian's
``docker-compose`` drives ``deploy/docker-compose.yml`` unchanged. What such a host lacks is made
here, once per machine where it can be kept:

- podman, debootstrap and docker-compose, from Debian (as root, where ``apt-get`` exists);
- default ulimits that runc may set in this sandbox: the host's own are refused ("error setting
  rlimit type 7: operation not permitted");
- runc as the OCI runtime where the host's cgroups are hybrid (v1 controllers and a cgroup2
  mount), which crun refuses;
- a base image, since no registry is reachable: Debian bookworm (Python 3.11 as ``python3``) made
  by debootstrap, imported, and kept as a tarball under ``~/.cache/pdserve/containers``;
- the health-check timer. Podman schedules each container's ``HEALTHCHECK`` with a systemd timer
  that runs ``podman healthcheck run ID``; without systemd nothing runs it and every container
  stays "starting". :class:`HealthcheckTimer` runs that same command at each container's interval.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.helpers.paths import REPO_ROOT

log = logging.getLogger("containers")

DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"
CACHE_DIR = Path(os.environ.get("PDSERVE_CONTAINER_CACHE", Path.home() / ".cache" / "pdserve" / "containers"))
BASE_IMAGE = "localhost/pdserve-base:bookworm"
BASE_TARBALL = CACHE_DIR / "pdserve-base-bookworm.tar"
DEBIAN_MIRROR = os.environ.get("PDSERVE_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
ULIMITS = '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n'
DEBIAN_PACKAGES = ("podman", "debootstrap", "docker-compose")


class Unavailable(Exception):
    """This machine cannot run the container tests; the message says why (the tests skip with it)."""


def run(argv: list[str], timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` that captures text and says what failed, with its output."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(argv)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return run(["podman", *args], timeout=timeout, check=check)


# ---------------------------------------------------------------------- machine set-up


def ensure_tools() -> None:
    """podman, debootstrap and docker-compose on PATH: installed from Debian if missing and allowed."""
    missing = [name for name in DEBIAN_PACKAGES if shutil.which(name) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(
            f"{', '.join(missing)} not installed, and apt-get cannot install them here (not root)"
        )
    log.info("installing %s from Debian", " ".join(missing))
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env)
    run(["apt-get", "install", "-y", "-qq", *missing], env=env)


def ensure_ulimits() -> None:
    """Default ulimits runc can set here, unless the machine's containers.conf sets its own."""
    if CONTAINERS_CONF.exists() and "default_ulimits" in CONTAINERS_CONF.read_text():
        return
    if os.geteuid() != 0:
        return  # rootless podman reads ~/.config/containers; nothing to fix there
    CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
    text = CONTAINERS_CONF.read_text() if CONTAINERS_CONF.exists() else ""
    if "[containers]" in text:  # one [containers] table: the setting goes into it
        text = text.replace("[containers]", ULIMITS.rstrip("\n"), 1)
    else:
        text += ("\n" if text else "") + ULIMITS
    CONTAINERS_CONF.write_text(text)
    log.info("%s: default ulimits set (runc refuses to raise the host's here)", CONTAINERS_CONF)


def hybrid_cgroups(mounts: Path = Path("/proc/self/mounts")) -> bool:
    """cgroup v1 controllers with a cgroup2 hierarchy mounted beside them (``/sys/fs/cgroup/unified``)."""
    kinds = {line.split()[2] for line in mounts.read_text().splitlines() if len(line.split()) > 2}
    return {"cgroup", "cgroup2"} <= kinds


def ensure_runtime() -> None:
    """runc as podman's OCI runtime on a host with hybrid cgroups, unless containers.conf names one.

    Podman picks crun first, and crun refuses such a host: "cgroups in hybrid mode not supported,
    drop all controllers from cgroupv2" (an AMD EPYC machine of this project's, 2026-11-26); runc,
    which Debian's podman also installs, runs there."""
    if os.geteuid() != 0 or not hybrid_cgroups() or shutil.which("runc") is None:
        return
    text = CONTAINERS_CONF.read_text() if CONTAINERS_CONF.exists() else ""
    if "runtime =" in text or "runtime=" in text:
        return
    CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
    if "[engine]" in text:
        text = text.replace("[engine]", '[engine]\nruntime = "runc"', 1)
    else:
        text += ("\n" if text else "") + '[engine]\nruntime = "runc"\n'
    CONTAINERS_CONF.write_text(text)
    log.info("%s: runtime runc (crun refuses this host's hybrid cgroups)", CONTAINERS_CONF)


def ensure_base_image() -> str:
    """The Debian bookworm base image, from podman's store, else the cached tarball, else debootstrap."""
    if podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
        return BASE_IMAGE
    if BASE_TARBALL.exists():
        log.info("loading the base image from %s", BASE_TARBALL)
        podman("load", "-i", str(BASE_TARBALL), timeout=300)
        return BASE_IMAGE
    started = time.monotonic()
    log.info("making the base image: debootstrap bookworm (python3, python3-venv) from %s", DEBIAN_MIRROR)
    with tempfile.TemporaryDirectory(prefix="pdserve-rootfs-") as rootfs:
        run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv",
                "bookworm",
                rootfs,
                DEBIAN_MIRROR,
            ],
            timeout=900,
        )
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        run(["podman", "import", "-", BASE_IMAGE], stdin=tar.stdout, timeout=300)
        tar.wait()
    log.info("base image %s made in %.0f s", BASE_IMAGE, time.monotonic() - started)
    with contextlib.suppress(OSError):  # a read-only home only loses the cache
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        podman("save", "-o", str(BASE_TARBALL), BASE_IMAGE, timeout=300)
    return BASE_IMAGE


def pip_configuration() -> tuple[str, list[str]]:
    """This machine's effective pip settings as a ``pip.conf`` text, and the local paths they name.

    The image's build installs the same wheels ``make test`` does: the local wheel directory (the
    CPU-only torch among them), the local indexes and the certificate bundle, mounted at the same
    paths. A plain build of the Dockerfile takes torch from its CPU wheel index instead.
    """
    listed = run([sys.executable, "-m", "pip", "config", "list"], check=False).stdout
    settings: dict[str, str] = {}
    for line in sorted(listed.splitlines(), key=lambda item: item.startswith(":env:")):  # env wins
        key, _, value = line.partition("=")
        settings[key.split(".", 1)[1]] = value.strip().strip("'\"")
    paths = []
    for value in settings.values():
        for token in value.split():
            path = token.removeprefix("file://")
            if path.startswith("/") and os.path.exists(path):
                paths.append(str(Path(path).parent) if path.endswith("/simple") else path)
    text = "[global]\n" + "".join(f"{key} = {value}\n" for key, value in settings.items())
    return text, sorted(set(paths))


def has_local_torch(paths: list[str]) -> bool:
    return any(Path(p).is_dir() and any(Path(p).glob("torch-*.whl")) for p in paths)


def build_image(tag: str, base_image: str) -> float:
    """``podman build`` of deploy/Dockerfile on ``base_image``; returns the seconds it took."""
    pip_conf, paths = pip_configuration()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-pip-") as conf_dir:
        conf = Path(conf_dir) / "pip.conf"
        conf.write_text(pip_conf)
        mounts = [f"{conf}:/etc/pip.conf:ro", "/etc/ssl/certs:/etc/ssl/certs:ro"]
        mounts += [f"{path}:{path}:ro" for path in paths if not path.startswith("/etc/ssl/certs")]
        argv = [
            "podman",
            "build",
            "--format",
            "docker",
            "--network",
            "host",
            "-f",
            str(DOCKERFILE),
            "-t",
            tag,
        ]
        argv += ["--build-arg", f"BASE_IMAGE={base_image}"]
        if has_local_torch(paths):
            argv += ["--build-arg", "TORCH_INDEX_URL="]  # pip's configuration names the CPU wheel
        for mount in mounts:
            argv += ["--volume", mount]
        log.info("building %s: %s", tag, shlex.join(argv))
        run_showing_steps([*argv, str(REPO_ROOT)], timeout=1500)
    # Earlier builds' stages (kept as the layer cache) go once they are an hour old.
    podman("image", "prune", "-f", "--filter", "until=1h", check=False)
    return time.monotonic() - started


def run_showing_steps(argv: list[str], timeout: float) -> None:
    """Run a ``podman build``, logging each step as it starts (and whether its cached layer was
    used); the whole output goes into the error if it fails."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as build:
        assert build.stdout is not None
        for line in build.stdout:
            lines.append(line)
            if " STEP " in line or line.startswith(("STEP ", "--> Using cache", "Successfully tagged")):
                log.info("  %s", line.rstrip()[:160])
            if time.monotonic() > deadline:
                build.kill()
        if build.wait() != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {build.returncode}:\n{''.join(lines[-80:])}")


def image_size_bytes(tag: str) -> int:
    return int(podman("image", "inspect", tag, "--format", "{{.Size}}").stdout.strip())


# ---------------------------------------------------------------------- podman at run time


@contextlib.contextmanager
def docker_api() -> Iterator[str]:
    """``podman system service`` on a private socket; yields the ``DOCKER_HOST`` that reaches it."""
    with tempfile.TemporaryDirectory(prefix="pdserve-podman-") as tmp:
        socket_path = Path(tmp) / "podman.sock"
        with open(Path(tmp) / "service.log", "w") as service_log:
            service = subprocess.Popen(
                ["podman", "system", "service", "--time=0", f"unix://{socket_path}"],
                stdout=service_log,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 30
            while not socket_path.exists():
                if service.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"podman system service did not start: {(Path(tmp) / 'service.log').read_text()}"
                    )
                time.sleep(0.1)
            yield f"unix://{socket_path}"
        finally:
            service.terminate()
            try:
                service.wait(timeout=10)
            except subprocess.TimeoutExpired:
                service.kill()


def healthcheck_interval_s(container: str) -> float | None:
    """The container's health-check interval, or None if it has no health check."""
    inspected = podman("inspect", container, "--format", "{{json .Config.Healthcheck}}", check=False)
    spec = json.loads(inspected.stdout or "null") if inspected.returncode == 0 else None
    if not spec or not spec.get("Test") or spec["Test"][0] == "NONE":
        return None
    return (spec.get("Interval") or 30_000_000_000) / 1e9  # nanoseconds, as Docker's API has it


class HealthcheckTimer:
    """Runs ``podman healthcheck run`` for every running container at its interval.

    What systemd's timers do for podman on a host that runs systemd: the container's own
    ``HEALTHCHECK`` (start period, retries and timeout included) decides, podman records the
    status, and compose's ``service_healthy`` conditions and ``ps`` read it.
    """

    def __init__(self, poll_s: float = 1.0) -> None:
        self.poll_s = poll_s
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="healthcheck-timer", daemon=True)
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="healthcheck")

    def __enter__(self) -> HealthcheckTimer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=30)
        self.pool.shutdown(wait=True)

    def _loop(self) -> None:
        intervals: dict[str, float | None] = {}
        due: dict[str, float] = {}
        running: set[str] = set()
        while not self.stopping.wait(self.poll_s):
            listed = podman("ps", "-q", "--no-trunc", check=False)
            now = time.monotonic()
            for container in listed.stdout.split():
                if container not in intervals:
                    intervals[container] = healthcheck_interval_s(container)
                    due[container] = now  # the first check at once, as podman starts its timer
                if intervals[container] is None or container in running or now < due[container]:
                    continue
                due[container] = now + intervals[container]
                running.add(container)
                self.pool.submit(self._check, container, running)

    @staticmethod
    def _check(container: str, running: set[str]) -> None:
        try:
            podman("healthcheck", "run", container, timeout=60, check=False)
        finally:
            running.discard(container)
