"""``pdserve bench serve``: P/D vs colocated serving on the same cores, under an open-loop load.

Up to three setups run one after the other in one invocation, each on fresh processes and the
same cores (``--cpus``, default the first two this process may use):

- ``colocated``: two independent ``pdserve serve`` engines behind ``pdserve router --policy
  round_robin`` (no ``--prefill``, so the router sends every request straight to an engine);
  each runs a whole prompt in one step, stalling the requests decoding on it meanwhile;
- ``colocated-chunked``: the same, with each step capped at a token budget chosen so that a
  step carrying a prefill chunk costs about one decode step (Sarathi-Serve's stall-free
  batching, the strongest colocated configuration). The budget is measured before the runs on
  the same model and core (``pdserve.bench.serve.chunk_sweep``) unless ``--chunk-tokens`` gives it;
- ``pd``: one ``pdserve prefill`` and one ``pdserve decode`` engine behind the router with
  ``--disagg-min-tokens 0``, so every request is prefilled on P and its KV pulled by D.

A performance claim must hold across runs: ``--repeats N`` runs the whole comparison N times
(every setup on fresh processes, every rate, fresh seeded prompts and arrivals per repeat, the
setups interleaved so drifting background load hits them alike). The report gives each key
metric's spread over the repeats, and a verdict of P/D against the best colocated setup per
rate and metric only where P/D is better (or worse) in every repeat.

Each engine (its front and its engine-core child: affinity is inherited) is pinned to one core
with ``OMP_NUM_THREADS=1``; the router and this client are not pinned. For each rate, requests
arrive as a Poisson process (seeded; the same prompts and arrival times for both setups, fresh
prompts for each rate and repeat so none hits the prefix cache of another); every request is
greedy with ``ignore_eos`` and streams its tokens back.

Latencies are taken on the client: TTFT from sending a request to its first token; ITL between
consecutive streamed messages (a message carrying k tokens counts k gaps of 1/k of the time);
TPOT = (e2e - TTFT) / (output tokens - 1). A request meets the SLO when TTFT <= ``--slo-ttft-ms``
and its own longest gap (or its ITL p90: ``--slo-itl-stat``) <= ``--slo-itl-ms``; goodput is the fraction of
requests that meet it and their number per second of the run. The P/D breakdown is the router's
own clock: ``queue`` (arrival to dispatch), ``prefill`` (dispatch to the prefill's token),
``transfer`` (prefill done to the decode engine's first token: decode queueing + KV pull + one
decode step), ``decode`` (the rest of the generation).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np

from pdserve import supervisor
from pdserve.bench.common.report import default_path, save_json
from pdserve.bench.serve import chunk_sweep
from pdserve.bench.serve.client import engine_info, run_requests, run_requests_openai, wait_router_ready
from pdserve.bench.serve.report import (
    RequestResult,
    front_overhead,
    plot_all,
    print_chunk_sweep,
    print_front_overhead,
    print_report,
    print_spread_and_verdicts,
    request_record,
    spread_by_rate,
    summarize,
    verdicts,
)
from pdserve.bench.serve.workload import OpenLoopWorkload, RequestSpec, load_dataset, parse_length
from pdserve.config import KV_TRANSPORTS
from pdserve.supervisor import SupervisedProcess, Supervisor

SETUPS = ("colocated", "colocated-chunked", "pd")
COLOCATED_SETUPS = ("colocated", "colocated-chunked")  # two `pdserve serve` engines each
HOST = "127.0.0.1"  # every process binds loopback
STARTUP_TIMEOUT_S = 600.0
IDLE_TIMEOUT_S = 60.0
GRACE_S = 10.0

# ---------------------------------------------------------------------- processes


class SetupProcesses:
    """The engines and router of one setup. ``stop()`` (also on exit of the ``with``) ends them all.

    A ``Supervisor`` runs them: each child is pinned to its cores, leads its own process group
    (its engine core is in it too) and gets SIGTERM from the kernel if this process dies; each
    ``start`` is a wave, and ``stop()`` ends the router's wave first, then the engines'.
    """

    def __init__(self, log_dir: str, env: dict[str, str], say: Callable[[str], None]) -> None:
        self.log_dir = log_dir
        self.env = env
        self.supervisor = Supervisor(grace_s=GRACE_S, progress=say)

    @property
    def children(self) -> list[SupervisedProcess]:
        """Every child started, in start order (not those that lost their port)."""
        return self.supervisor.children

    def __enter__(self) -> SetupProcesses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(
        self, members: list[tuple[str, Callable[[int], list[str]], set[int] | None]]
    ) -> list[SupervisedProcess]:
        """Start ``(name, argv for a port, cpus)`` members on free ports and wait until they serve
        (a child whose port was taken first is started again on a new one)."""

        def build(
            todo: Sequence[tuple[str, Callable[[int], list[str]], set[int] | None]],
        ) -> list[SupervisedProcess]:
            ports = supervisor.pick_free_ports(HOST, len(todo))
            return [
                SupervisedProcess(
                    name,
                    [sys.executable, "-m", "pdserve", *argv(port)],
                    os.path.join(self.log_dir, f"{name}.log"),
                    address=f"{HOST}:{port}",
                    env=self.env,
                    cpus=cpus,
                )
                for (name, argv, cpus), port in zip(todo, ports, strict=True)
            ]

        return self.supervisor.start(members, build, timeout_s=STARTUP_TIMEOUT_S)

    def check_alive(self) -> None:
        self.supervisor.check()

    def stop(self) -> None:
        """Router first, then the engines: SIGTERM, SIGKILL to each process group after a grace."""
        self.supervisor.stop()


def start_setup(
    setup: str, procs: SetupProcesses, args: argparse.Namespace, cpus: list[int]
) -> tuple[list[SupervisedProcess], str | None]:
    """Start the engines of ``setup`` pinned one per core, then its router: ([engine, engine,
    router], the router's OpenAI API URL when an ``--api`` needs it)."""
    model = ["--model", args.model] if args.model else []
    engine_args = ["--max-model-len", str(args.max_model_len), *shlex.split(args.engine_args)]
    if setup == "colocated-chunked":  # after --engine-args: the last of a repeated flag wins
        engine_args += chunk_sweep.engine_args_for_budget(args.chunk_tokens)
    roles = ["serve", "serve"] if setup in COLOCATED_SETUPS else ["prefill", "decode"]

    def engine_argv(role: str) -> Callable[[int], list[str]]:
        def build(port: int) -> list[str]:
            argv = [role, "--host", HOST, "--port", str(port), *model, *engine_args]
            if role != "serve":
                argv += ["--kv-transport", args.kv_transport, "--engine-id", f"bench-{role}-{port}"]
            return argv

        return build

    engines = procs.start(
        [(f"{setup}-{role}-{i}", engine_argv(role), {cpus[i % len(cpus)]}) for i, role in enumerate(roles)]
    )
    addresses = [cast(str, e.address) for e in engines]  # built with one each
    if setup in COLOCATED_SETUPS:
        upstream = ["--decode", ",".join(addresses)]
    else:
        upstream = ["--prefill", addresses[0], "--decode", addresses[1], "--disagg-min-tokens", "0"]

    http_url: list[str] = []  # the URL of the router actually started (its port may be retried)

    def router_argv(port: int) -> list[str]:
        argv = ["router", "--host", HOST, "--port", str(port), *model, "--policy", "round_robin", *upstream]
        if "openai" in apis(args):
            (http_port,) = supervisor.pick_free_ports(HOST, 1)
            http_url[:] = [f"http://{HOST}:{http_port}/v1"]
            argv += ["--http-port", str(http_port)]
        return argv

    (router,) = procs.start([(f"{setup}-router", router_argv, None)])
    return [*engines, router], (http_url[0] if http_url else None)


def apis(args: argparse.Namespace) -> list[str]:
    """The front doors to measure, in run order."""
    return ["grpc", "openai"] if args.api == "both" else [args.api]


# ---------------------------------------------------------------------- driver


@dataclass
class SetupRun:
    """What one setup produced over every rate of one repeat."""

    rows: list[dict] = field(default_factory=list)  # one per rate (and front door)
    records: list[dict] = field(default_factory=list)  # one per request
    samples: dict[tuple[str, float, str], list[float]] = field(
        default_factory=dict
    )  # {(setup, rate, "ttft"|"itl"): ms}
    kv_transport: str | None = None


def run_setup(
    setup: str,
    procs: SetupProcesses,
    workload: OpenLoopWorkload,
    args: argparse.Namespace,
    cpus: list[int],
    say: Callable[[str], None],
    repeat: int = 0,
) -> SetupRun:
    """Start ``setup``, warm it up, then run every rate on it, one after the other from idle.

    Repeat ``r`` draws rate ``i``'s requests from stream ``r * len(rates) + i``: each repeat is a
    new seeded sample of prompts and arrivals (so a claim that holds in every repeat does not hang
    on one lucky draw), the same for every setup, and repeat 0 is what a single run draws."""
    from tqdm import tqdm

    run = SetupRun()
    of = f" (repeat {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
    say(f"{setup}{of}: starting engines on cpus {cpus[:2]} ({args.model or 'bundled SmolLM2-135M'})")
    (first_engine, _, router_child), http_url = start_setup(setup, procs, args, cpus)
    router = router_child.address
    assert router is not None and first_engine.address is not None  # start_setup gives each one
    info = engine_info(first_engine.address)
    workload.token_range = (min(256, info.vocab_size // 4), info.vocab_size)
    run.kv_transport = info.kv_transport or None
    wait_router_ready(router, num_engines=2, timeout_s=STARTUP_TIMEOUT_S)

    async def send_async(api: str, specs: list[RequestSpec], tag: str, bar=None) -> list[RequestResult]:
        if api == "openai":
            assert http_url is not None  # the router got an HTTP port: "openai" is in apis(args)
            return await run_requests_openai(http_url, specs, tag, bar)
        return await run_requests(router, specs, tag, bar)

    async def send_both(specs: list[RequestSpec], tag: str, bar=None) -> list[list[RequestResult]]:
        """Request k goes through gRPC if k is even, through the OpenAI API if odd: one open loop
        (same arrival process, same engine load at the same moments), so the difference between
        the two halves is the front door's, not the engines' drift between two runs."""
        halves = await asyncio.gather(
            send_async("grpc", specs[0::2], tag, bar), send_async("openai", specs[1::2], tag, bar)
        )
        return list(halves)

    for api in apis(args):
        for spec in workload.draw(args.warmup, 1.0, stream=0):  # one by one: every engine and path warm
            (result,) = asyncio.run(send_async(api, [replace(spec, arrival_s=0.0)], f"warm-{setup}"))
            if result.error:
                raise RuntimeError(f"{setup}: warm-up request through {api} failed: {result.error}")
    for i, rate in enumerate(args.rates, start=1):
        wait_router_ready(router, num_engines=2, timeout_s=IDLE_TIMEOUT_S)
        specs = workload.draw(args.num_requests, rate, stream=repeat * len(args.rates) + i)
        desc = f"{setup} @ {rate:g} req/s{of}" + (
            " (gRPC and OpenAI API alternating)" if args.api == "both" else ""
        )
        with tqdm(total=len(specs), desc=desc, unit="req", disable=args.no_progress) as bar:
            if args.api == "both":
                per_api = dict(
                    zip(apis(args), asyncio.run(send_both(specs, f"{setup}-{rate:g}", bar)), strict=True)
                )
            else:
                per_api = {args.api: asyncio.run(send_async(args.api, specs, f"{setup}-{rate:g}", bar))}
        procs.check_alive()
        for api, results in per_api.items():
            label = setup if api == "grpc" else f"{setup}/openai"
            records = [request_record(label, rate, r, args, repeat=repeat) for r in results]
            run.rows.append(summarize(label, rate, results, records, repeat=repeat))
            run.records += records
            run.samples[(label, rate, "ttft")] = [
                rec["ttft_ms"] for rec in records if rec["ttft_ms"] is not None
            ]
            run.samples[(label, rate, "itl")] = [g for r in results if r.error is None for g in r.itls_ms()]
            errors = sorted({r.error for r in results if r.error})
            if errors:
                say(f"{label} @ {rate:g} req/s: {run.rows[-1]['failed']} failed: {errors[:3]}")
    say(f"{setup}: stopping")
    return run


def choose_chunk_tokens(
    args: argparse.Namespace,
    workload: OpenLoopWorkload,
    cpus: list[int],
    log_dir: str,
    env: dict[str, str],
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The step token budget of ``colocated-chunked``: ``--chunk-tokens`` if given, else measured
    by ``pdserve.bench.serve.chunk_sweep`` on the first core with the engines' threading (before any
    setup starts, so nothing of ours competes with it) and chosen by its rule. Returns what the
    JSON records: the budget, where it came from, the rule, and the sweep behind it."""
    if args.chunk_tokens is not None:
        return {"tokens": args.chunk_tokens, "source": "--chunk-tokens", "reason": "given on the command line",
                "max_ratio": None, "max_step_ms": None, "sweep": None}  # fmt: skip
    prompt_len, output_len = workload.mean_lengths()
    finite = [r for r in args.rates if np.isfinite(r)]
    # Round robin splits the arrivals over the two engines; the highest rate is where a stall
    # hurts most. All-at-once rates have no steady state: half the requests per engine.
    batch = args.chunk_batch
    if batch is None and not finite:
        batch = min(chunk_sweep.MAX_BATCH, -(-args.num_requests // 2))
    say(
        f"chunk sweep: step budgets {args.chunk_candidates} on cpu {cpus[0]} (a few minutes on the bundled model)"
    )
    sweep = chunk_sweep.run_pinned(
        cpus[0], log_dir, env,
        model=args.model, prompt_len=round(prompt_len), output_len=output_len,
        candidates=args.chunk_candidates, batch=batch,
        rate_per_engine=max(finite, default=0.0) / 2, repeats=args.chunk_sweep_repeats,
        max_model_len=args.max_model_len, seed=args.seed,
    )  # fmt: skip
    # A stall within the inter-token SLO costs no goodput (with --slo-itl-stat max, every gap
    # counts; with p90 the SLO is looser than one step, so the same bound is conservative).
    tokens, reason = chunk_sweep.choose_chunk(sweep["rows"], args.chunk_max_ratio, args.slo_itl_ms)
    return {"tokens": tokens, "source": "sweep", "reason": reason, "max_ratio": args.chunk_max_ratio,
            "max_step_ms": args.slo_itl_ms, "sweep": sweep}  # fmt: skip


def _json_rate(row: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: an all-at-once rate is written as "inf"."""
    return {**row, "rate": row["rate"] if np.isfinite(row["rate"]) else "inf"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    p.add_argument(
        "--api",
        default="grpc",
        choices=["grpc", "openai", "both"],
        help="front door the client uses: the router's gRPC API, its OpenAI HTTP API, or both (each "
        "rate's requests alternate between them in one open loop; rows 'SETUP' and 'SETUP/openai' "
        "get half each, and the report adds the HTTP front's overhead)",
    )
    p.add_argument(
        "--rates", type=float, nargs="+", default=[0.1, 0.25, 0.5], help="req/s (inf: all at once)"
    )
    p.add_argument("--num-requests", type=int, default=32, help="per rate and setup")
    p.add_argument("--prompt-len", default="512", help="N or LO:HI (uniform)")
    p.add_argument("--output-len", default="64", help="N or LO:HI (uniform)")
    p.add_argument(
        "--dataset", default=None, help='JSONL of {"prompt_len": .., "output_len": ..} (overrides lengths)'
    )
    p.add_argument(
        "--shared-prefix-frac", type=float, default=0.0, help="this fraction of each prompt is shared"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=2, help="requests sent one by one before each setup's runs")
    p.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    p.add_argument("--slo-itl-ms", type=float, default=500.0)
    p.add_argument(
        "--slo-itl-stat",
        default="max",
        choices=["p90", "max"],
        help="which of a request's gaps is held to --slo-itl-ms: the longest (a stall fails it) or its p90",
    )
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: max(2048, longest request)")
    p.add_argument(
        "--engine-args", default="", help='extra args for every engine: --engine-args="--num-blocks 512"'
    )
    p.add_argument("--kv-transport", default="auto", choices=list(KV_TRANSPORTS))
    p.add_argument("--cpus", default=None, help="comma-separated cores, one per engine (default: first two)")
    p.add_argument("--json", default=None, help="default: bench-results/serve.json")
    p.add_argument("--plot-dir", default=None, help="default: bench-results/")
    p.add_argument("--log-dir", default=None, help="process logs (default: a temp dir, kept on failure)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the whole comparison this many times (fresh processes and prompts each time); "
        "the report gives the spread and claims only what holds in every repeat",
    )
    chunk = p.add_argument_group("colocated-chunked (the tuned chunked-prefill baseline)")
    chunk.add_argument(
        "--chunk-tokens", type=int, default=None, help="step token budget (default: chosen by a sweep)"
    )
    chunk.add_argument(
        "--chunk-candidates",
        type=int,
        nargs="+",
        default=list(chunk_sweep.DEFAULT_CANDIDATES),
        help="budgets the sweep measures",
    )
    chunk.add_argument(
        "--chunk-max-ratio",
        type=float,
        default=chunk_sweep.DEFAULT_MAX_RATIO,
        help="pick the largest budget whose step costs at most this many decode steps",
    )
    chunk.add_argument(
        "--chunk-batch", type=int, default=None, help="decode batch of the sweep (default: Little's law)"
    )
    chunk.add_argument("--chunk-sweep-repeats", type=int, default=2, help="timed rounds over the candidates")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        workload = OpenLoopWorkload(
            prompt_len=parse_length(args.prompt_len),
            output_len=parse_length(args.output_len),
            dataset=load_dataset(args.dataset) if args.dataset else None,
            shared_prefix_frac=args.shared_prefix_frac,
            seed=args.seed,
            token_range=(0, 1),  # set once the engines tell us their vocabulary
        )
        if not 0.0 <= args.shared_prefix_frac <= 1.0:
            raise ValueError(f"--shared-prefix-frac must be in [0, 1], got {args.shared_prefix_frac}")
        if args.num_requests < 1 or any(r <= 0 for r in args.rates):
            raise ValueError("--num-requests and every rate must be positive")
        if args.repeats < 1 or args.chunk_sweep_repeats < 1:
            raise ValueError("--repeats and --chunk-sweep-repeats must be >= 1")
        if (args.chunk_tokens is not None and args.chunk_tokens < 1) or min(args.chunk_candidates) < 1:
            raise ValueError("--chunk-tokens and every --chunk-candidates budget must be >= 1")
        if args.chunk_batch is not None and not 1 <= args.chunk_batch <= chunk_sweep.MAX_BATCH:
            raise ValueError(f"--chunk-batch must be in [1, {chunk_sweep.MAX_BATCH}]")
        allowed = sorted(os.sched_getaffinity(0))
        cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else allowed[:2]
        if not set(cpus) <= set(allowed):
            raise ValueError(f"--cpus {args.cpus}: this process may only use cpus {allowed}")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.max_model_len = args.max_model_len or max(2048, workload.max_total_len())
    if len(cpus) < 2:
        print(f"warning: only cpu {cpus} available: both engines share it", file=sys.stderr)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} before start: other work shares these cores, timings are noisy",
              file=sys.stderr)  # fmt: skip
    own_log_dir = args.log_dir is None
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-serve-")
    os.makedirs(log_dir, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.setdefault("PDSERVE_CLUSTER_TOKEN", secrets.token_hex(16))

    from tqdm import tqdm

    def say(message: str) -> None:
        tqdm.write(f"[bench serve] {message}", file=sys.stderr)

    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the children

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main_thread else None
    rows: list[dict] = []
    records: list[dict] = []
    samples: dict[tuple[str, float, str], list[float]] = {}  # {(setup, rate, "ttft"|"itl"): ms, all repeats}
    kv_transport_used = None
    chunk: dict[str, Any] | None = None
    load_before = os.getloadavg()
    failed = False
    try:
        if "colocated-chunked" in args.setups:
            chunk = choose_chunk_tokens(args, workload, cpus, log_dir, env, say)
            args.chunk_tokens = chunk["tokens"]
            print_chunk_sweep(chunk)
        for repeat in range(args.repeats):  # repeat-major: drifting background load hits every setup
            for setup in args.setups:
                with SetupProcesses(log_dir, env, say) as procs:
                    run = run_setup(setup, procs, workload, args, cpus, say, repeat=repeat)
                rows += run.rows
                records += run.records
                for key, values in run.samples.items():
                    samples.setdefault(key, []).extend(values)
                kv_transport_used = run.kv_transport or kv_transport_used
    except Exception as exc:
        failed = True
        print(f"error: {exc}\n(process logs in {log_dir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        failed = True
        print(f"\ninterrupted; every process stopped (logs in {log_dir})", file=sys.stderr)
        return 130
    except BaseException:  # SystemExit from SIGTERM
        failed = True
        print(f"\nterminated; every process stopped (logs in {log_dir})", file=sys.stderr)
        raise
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
        if own_log_dir and not failed:
            shutil.rmtree(log_dir, ignore_errors=True)

    print_report(rows, args)
    overhead = front_overhead(rows)
    if overhead:
        print_front_overhead(overhead)
    spreads, claims = spread_by_rate(rows), verdicts(rows, COLOCATED_SETUPS, "pd")
    print_spread_and_verdicts(spreads, claims, args.repeats)
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot_dir", "log_dir", "no_progress")}
    payload = {
        "config": {
            **config,
            "cpus": cpus[:2],
            "kv_transport_used": kv_transport_used,
            "rates": [r if np.isfinite(r) else "inf" for r in args.rates],
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "chunk": chunk,
        "rows": [_json_rate(r) for r in rows],
        "spread": [_json_rate(r) for r in spreads],
        "verdicts": [_json_rate(r) for r in claims],
        "front_overhead": [_json_rate(r) for r in overhead],
        "requests": [_json_rate(r) for r in records],
    }
    save_json(args.json or default_path("serve", "json"), payload)
    plot_dir = args.plot_dir or os.path.dirname(default_path("serve", "json"))
    labels = [setup if api == "grpc" else f"{setup}/openai" for setup in args.setups for api in apis(args)]
    plot_all(rows, samples, args.rates, labels, plot_dir, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
