"""``pdserve bench peers``: pdserve next to vLLM-CPU on the same machine, measured by vLLM's own client.

The client is a third party's: ``vllm bench serve`` (``--backend openai``, the completions
endpoint, streamed) from a side venv, so the numbers are what vLLM's users would measure. Setups,
one after the other, each on fresh processes bound to 127.0.0.1 and otherwise at their defaults:

- ``vllm``: vLLM-CPU's OpenAI server on the same weights (the GGUF exported to an HF directory,
  since vLLM-CPU cannot read a GGUF), with ``--vllm-args`` (default: an explicit 2 GB KV cache,
  because vLLM-CPU's default reserves 92% of the NUMA node's memory and refuses to start when
  other processes hold some of it);
- ``default-cluster``: ``pdserve cluster --prefill 1 --decode 1 --http-port P`` as a user would
  start it;
- ``colocated``: one ``pdserve serve`` engine behind ``pdserve router --decode`` (no transfer);
- ``llamacpp``: llama.cpp's ``llama-server`` on the GGUF itself, built once in a side venv
  (``pdserve.bench.peers.llamacpp``; ``--llama-server PATH`` runs another build), with
  ``--llamacpp-threads`` threads (default 2) and as many slots (``--parallel``) as the run's largest
  concurrency;
- ``gguf-cluster``, ``gguf-colocated``: ``default-cluster`` and ``colocated`` with
  ``--gguf-engine-args`` (default ``--quantization gguf``) after ``--engine-args`` on every engine,
  passed through as they are: pdserve serving the GGUF's own blocks, next to llama.cpp;
- ``gguf-a8-cluster``, ``gguf-a8-colocated``: the same with ``--quantization gguf-a8`` (the
  file's blocks, activations quantized to int8 in the decode matmuls as llama.cpp does);
- ``dense-cluster``, ``dense-colocated``: the same with ``--quantization none`` (dense weights
  in ``--dtype``, what the defaults served before ``--quantization auto``).

Each setup gets the same load points, in order: closed loops of 1 and 8 concurrent streams, then
open loops at each ``--rates`` value (Poisson arrivals). Every request has a random prompt of
``--input-len`` tokens and ``--output-len`` output tokens (``--ignore-eos``), greedy. Before the
measured runs a few warm-up requests are sent with another seed (``vllm bench serve``'s own
warm-up resends the first measured prompt, which then hits the prefix cache). Each load point
of a repeat has its own seed, the same for every setup, and ``--repeats`` runs everything again
with new prompts, the setups interleaved so drifting background load hits them alike.

The report gives, per repeat, each setup's TTFT p50, ITL p50 (the client's per-chunk gaps),
TPOT p50 and output tok/s, and each setup's ratios to vLLM and to llama.cpp (those that ran) in
the same repeat and load point (tok/s: above 1 is faster than the peer; ITL and TTFT: below 1 is
faster); then the spread of each over the repeats. JSON and PNG as every benchmark
(``pdserve.bench.common.report``).

``--scenario long`` replaces the load points by one run of two clients at once: long prompts
arriving among streaming decodes, each setup's goodput under an SLO on every inter-token gap and
its ratio to vLLM's (``pdserve.bench.peers.long_scenario``; bench-results/peers_long.json and
.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.bench.common.machine import git_commit, machine_info, machine_line
from pdserve.bench.common.report import default_path, save_json
from pdserve.bench.peers import llamacpp, long_report, long_scenario, side_venv
from pdserve.bench.peers.client import Context, client_argv, log_tail, random_dataset, run_client
from pdserve.bench.peers.foreign_load import ForeignLoad
from pdserve.bench.peers.guidellm_client import GUIDELLM_SPEC, ensure_guidellm, guidellm_argv, parse_guidellm
from pdserve.bench.peers.long_scenario import MAX_WARMUP_PROMPTS, LongScenario
from pdserve.bench.peers.process_cpu import ProcessCpu
from pdserve.bench.peers.report import (
    LLAMACPP,
    LoadPoint,
    add_peer_ratios,
    add_ratios,
    failed_row,
    parse_result,
    plot,
    print_repeat_tables,
    print_spread,
    print_sustained_rates,
    spread_by_load,
    sustained_rates,
)
from pdserve.bench.peers.servers import (
    DEFAULT_GGUF_ENGINE_ARGS,
    DEFAULT_SETUPS,
    DEFAULT_VLLM_ARGS,
    SETUPS,
    served_model_name,
    start_setup,
)
from pdserve.supervisor import Supervisor

DEFAULT_LLAMACPP_PARALLEL = 8  # llama-server's fewest slots in a run with open loops (no concurrency cap)
WARMUP_SEED_OFFSET = 999  # the warm-up prompts' seed, apart from every load point's
# A warm-up the client reports as failed is sent again once before the run gives up: guidellm 0.8.1
# once reported none of 4 requests that vLLM-CPU had answered 200 ("No measurement start or end
# times available"), which ended a 2-repeat run in its second repeat.
WARMUP_ATTEMPTS = 2


# ---------------------------------------------------------------------- client


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    points = []
    if args.num_prompts_c1 > 0:
        points.append(LoadPoint.closed(1, args.num_prompts_c1))
    if args.num_prompts_c8 > 0:
        points.append(LoadPoint.closed(8, args.num_prompts_c8))
    for streams in dict.fromkeys(args.streams):  # more closed loops: 32, 64 streams ...
        if streams not in (1, 8):
            points.append(LoadPoint.closed(streams, streams * args.prompts_per_stream))
    if args.num_prompts_rate > 0:
        points += [LoadPoint.open(rate, args.num_prompts_rate) for rate in args.rates]
    return points


def measure(ctx: Context, setup: str, servers: list[int], base_url: str, model_name: str, load: LoadPoint,
            seed: int, repeat: int, dataset: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """One client run against ``setup`` (its processes: ``servers``) on ``dataset`` (default: the
    sweep's lengths): its row (a failed row if the client wrote no result), with the cores other
    work kept busy meanwhile."""
    args = ctx.args
    tag = f"{setup}-r{repeat}-{load.name}"
    result_dir = os.path.join(ctx.log_dir, "results")
    result_path = os.path.join(result_dir, f"{tag}.json")
    log_path = os.path.join(ctx.log_dir, f"client-{tag}.log")
    guidellm = ctx.guidellm if dataset is None else None  # the long scenario's datasets are vLLM's
    if guidellm is not None:
        argv = guidellm_argv(guidellm, base_url, model_name, ctx.hf_dir, load, args.input_len,
                             args.output_len, seed, result_path)  # fmt: skip
    else:
        dataset = dataset or random_dataset(args.input_len, args.output_len)
        argv = client_argv(
            ctx, setup, base_url, model_name, dataset, load.client_args(), seed, result_dir, f"{tag}.json"
        )
    # other work on the machine during the run, and each server process's own CPU time
    with ForeignLoad(servers) as foreign, ProcessCpu(servers) as cpu:
        code = run_client(ctx, argv, log_path, f"{setup} {load.name}")
    if code != 0 or not os.path.exists(result_path):
        tail = log_tail(log_path)
        ctx.say(f"{setup} {load.name}: the client exited with {code}; {log_path} ends:\n{tail}")
        row = failed_row(setup, repeat, load, f"client exit {code}: {tail.strip().splitlines()[-1:]}")
    else:
        with open(result_path) as f:
            result = json.load(f)
        if guidellm is not None:
            row = parse_guidellm(result, setup, repeat, load)
        else:
            row = parse_result(result, setup, repeat, load)
    per_token = cpu.us_per_token(row.get("out_tokens"))
    return {
        **row,
        "seed": seed,
        "other_cores": foreign.cores,
        "cpu_s": cpu.seconds,
        "cpu_us_per_token": per_token,
        "outside_engines_us_per_token": (per_token or {}).get("outside_engines"),
    }


def run_setup(ctx: Context, setup: str, repeat: int, loads: list[LoadPoint],
              scenario: LongScenario | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Start ``setup``, warm it up, run every load point on it (or ``scenario``), stop it."""
    args = ctx.args
    of = f" (repeat {repeat + 1}/{args.repeats})"
    ctx.say(f"{setup}{of}: starting")
    rows = []

    def progress(message: str) -> None:
        if message.startswith("waiting for") and sup.children:  # what a slow start is doing
            message += f" | {log_tail(sup.children[-1].log_path, 1).strip()[:120]}"
        ctx.say(message)

    with Supervisor(grace_s=30.0, progress=progress, poll_s=1.0) as sup:
        base_url = start_setup(setup, sup, ctx)
        model_name = served_model_name(base_url)
        servers = [child.pid for child in sup.children if child.pid is not None]
        ctx.say(f"{setup}: serving {model_name!r} at {base_url}")
        num_warmup = args.warmup_prompts if scenario is None else min(args.warmup_prompts, MAX_WARMUP_PROMPTS)
        if num_warmup > 0:
            warmup = LoadPoint("warmup", num_warmup, max_concurrency=num_warmup)
            seed = args.seed + 1000 * repeat + WARMUP_SEED_OFFSET
            dataset = scenario.warmup_dataset() if scenario else None
            for attempt in range(1, WARMUP_ATTEMPTS + 1):
                row = measure(ctx, setup, servers, base_url, model_name, warmup, seed, repeat, dataset)
                if row["completed"] == warmup.num_prompts:
                    break
                failure = f"{setup}: warm-up failed ({row['failed']} failed: {row['error']})"
                if attempt == WARMUP_ATTEMPTS:
                    raise RuntimeError(failure)
                sup.check()  # a server that died is not tried again
                ctx.say(f"{failure}; warming up again ({attempt + 1}/{WARMUP_ATTEMPTS})")
        if scenario is not None:
            row = long_scenario.measure(ctx, scenario, setup, servers, base_url, model_name, repeat)
            sup.check()  # a server that died mid-run fails the benchmark, naming it
            rows.append({**row, "served_model_name": model_name})
            ctx.say(f"{setup} {long_scenario.SCENARIO}{of}: {long_scenario.summary(row)}")
        for index, load in enumerate(loads if scenario is None else []):
            row = measure(
                ctx, setup, servers, base_url, model_name, load, args.seed + 1000 * repeat + index, repeat
            )
            row["served_model_name"] = model_name
            sup.check()  # a server that died mid-run fails the benchmark, naming it
            rows.append(row)
            ctx.say(f"{setup} {load.name}{of}: {row['completed']}/{load.num_prompts} done, "
                    f"TTFT p50 {_ms(row['ttft_ms_p50'])}, ITL p50 {_ms(row['itl_ms_p50'])}, "
                    f"{_num(row['out_tok_per_s'])} out tok/s")  # fmt: skip
        ctx.say(f"{setup}: stopping")
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--setups",
        nargs="+",
        default=list(DEFAULT_SETUPS),
        choices=SETUPS,
        help="servers to compare, run in this order (gguf-*: pdserve with --gguf-engine-args)",
    )
    p.add_argument(
        "--scenario",
        choices=("sweep", long_scenario.SCENARIO),
        default="sweep",
        help="sweep: the load points below; long: long prompts arriving among streams, under an SLO "
        "(pdserve.bench.peers.long_scenario; its flags below)",
    )
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (EOS ignored)")
    p.add_argument("--num-prompts-c1", type=int, default=16, help="prompts at 1 stream (0: skip)")
    p.add_argument("--num-prompts-c8", type=int, default=64, help="prompts at 8 streams (0: skip)")
    p.add_argument("--streams", type=int, nargs="*", default=[],
                   help="more closed loops after 1 and 8 streams (--streams 32 64: how throughput "
                        "holds as load grows), each with --prompts-per-stream prompts a stream")  # fmt: skip
    p.add_argument("--prompts-per-stream", type=int, default=8,
                   help="prompts a stream at each --streams point (default 8, as 64 at 8 streams)")  # fmt: skip
    p.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0], help="req/s of the open loops")
    p.add_argument("--num-prompts-rate", type=int, default=32, help="prompts per rate (0: skip the rates)")
    p.add_argument("--warmup-prompts", type=int, default=4, help="sent at once before the runs, not measured")
    p.add_argument(
        "--repeats", type=int, default=2, help="run everything this many times, setups interleaved"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument(
        "--engine-args",
        default="",
        help='extra args of every pdserve engine: --engine-args="--num-blocks 512"',
    )
    p.add_argument(
        "--cluster-args",
        default="",
        help='extra args of the cluster setups\' `pdserve cluster`: --cluster-args="--prefill-cpus 0,1"',
    )
    p.add_argument(
        "--gguf-engine-args",
        default=DEFAULT_GGUF_ENGINE_ARGS,
        help="appended to --engine-args in the gguf-cluster and gguf-colocated setups, as it is "
        f"(default: {DEFAULT_GGUF_ENGINE_ARGS!r})",
    )
    p.add_argument(
        "--vllm-args",
        default=DEFAULT_VLLM_ARGS,
        help="extra args of vLLM's server (default: a 2 GB KV cache; vLLM-CPU's own default reserves "
        "92%% of the memory node and refuses to start when other processes hold some of it)",
    )
    p.add_argument(
        "--client",
        default="vllm",
        choices=["vllm", "guidellm"],
        help="who sends the requests: vLLM's `vllm bench serve` (the default) or guidellm (its own venv "
        "under the peer cache; a heavier client, ~0.9 of a core here). The long scenario always uses vLLM's",
    )
    p.add_argument("--client-args", default="", help="extra args of `vllm bench serve`")
    p.add_argument(
        "--llama-server",
        default=None,
        help="a llama-server binary of your own (default: the one built in the peer cache)",
    )
    p.add_argument(
        "--llamacpp-threads", type=int, default=2, help="llama-server's threads: the cores it gets"
    )
    p.add_argument(
        "--llamacpp-parallel",
        type=int,
        default=None,
        help="llama-server's slots (default: the run's largest concurrency; "
        f"{DEFAULT_LLAMACPP_PARALLEL} with open loops alone)",
    )
    p.add_argument("--llamacpp-args", default="", help="extra args of llama-server")
    p.add_argument(
        "--peer-cache",
        default=None,
        help=f"side venv and exported weights (default: {side_venv.DEFAULT_CACHE})",
    )
    p.add_argument("--rebuild-venv", action="store_true", help="build the side venv again")
    p.add_argument("--rebuild-llamacpp", action="store_true", help="build llama-server again")
    p.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds for a server to answer /health"
    )
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds for one client run")
    p.add_argument("--json", default=None, help="default: bench-results/peers.json (peers_long.json)")
    p.add_argument("--plot", default=None, help="default: the JSON path with .png")
    p.add_argument(
        "--log-dir", default=None, help="logs and client results (default: a temp dir, kept on failure)"
    )
    long_scenario.add_arguments(p)
    return p


def _resolve_model(
    args: argparse.Namespace, cache: str, say: Callable[[str], None]
) -> tuple[str, str | None]:
    """(HF directory, GGUF or None) of ``--model``: a GGUF is exported once for vLLM and the client."""
    from pdserve.engine.model.loader import _resolve

    path = _resolve(args.model)
    if path.endswith(".gguf"):
        return side_venv.export_hf(path, cache, say), path
    return path, None


def llamacpp_slots(args: argparse.Namespace, loads: Sequence[LoadPoint],
                   scenario: LongScenario | None) -> tuple[int, int]:  # fmt: skip
    """(slots, tokens per slot) of llama-server for this run: a slot for every request the client
    keeps in flight at once (closed loops, warm-up; the long scenario's streams and its warm-up's
    long prompts; the open loops' excess waits in the server's queue, as in pdserve's), each
    holding the longest request."""
    if scenario is not None:
        parallel = scenario.stream_concurrency + MAX_WARMUP_PROMPTS
        longest = scenario.max_model_len
    else:
        closed = [lp.max_concurrency for lp in loads if lp.max_concurrency is not None]
        opened = [DEFAULT_LLAMACPP_PARALLEL] if any(lp.request_rate is not None for lp in loads) else []
        parallel = max([*closed, *opened, args.warmup_prompts])
        longest = args.input_len + args.output_len
    return args.llamacpp_parallel or parallel, llamacpp.slot_context(longest)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setups = list(dict.fromkeys(args.setups))
    if min(args.input_len, args.output_len, args.repeats) < 1 or any(r <= 0 for r in args.rates):
        print("error: --input-len, --output-len, --repeats and every rate must be positive", file=sys.stderr)
        return 2
    if any(n < 1 for n in args.streams) or args.prompts_per_stream < 1:
        print("error: every --streams count and --prompts-per-stream must be positive", file=sys.stderr)
        return 2
    scenario = LongScenario.from_args(args) if args.scenario == long_scenario.SCENARIO else None
    if scenario is not None and (problem := scenario.problem()):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    loads = load_points(args) if scenario is None else []
    if scenario is None and not loads:
        print("error: no load point: every prompt count is 0", file=sys.stderr)
        return 2
    if scenario is not None:  # the long prompts and their outputs exceed pdserve's default 2048
        args.engine_args = scenario.engine_args(args.engine_args)
    if LLAMACPP in setups and args.llama_server and not os.access(args.llama_server, os.X_OK):
        print(f"error: --llama-server {args.llama_server} is not an executable", file=sys.stderr)
        return 2
    if min(args.llamacpp_threads, args.llamacpp_parallel or 1) < 1:
        print("error: --llamacpp-threads and --llamacpp-parallel must be positive", file=sys.stderr)
        return 2

    def say(message: str) -> None:
        print(f"[bench peers] {message}", file=sys.stderr, flush=True)

    started = time.monotonic()
    load = os.getloadavg()[0]
    if load > 0.5:
        say(f"note: load average {load:.1f} before start: other work shares these cores, timings are noisy")
    cache = side_venv.cache_dir(args.peer_cache)
    machine = machine_info()
    try:
        venv = side_venv.ensure_venv(cache, say, rebuild=args.rebuild_venv)
        hf_dir, gguf = _resolve_model(args, cache, say)
        if LLAMACPP in setups and gguf is None:
            say("skipping llamacpp: --model is not a GGUF")
            setups.remove(LLAMACPP)
        guidellm = (
            ensure_guidellm(cache, say, rebuild=args.rebuild_venv) if args.client == "guidellm" else None
        )
        llama_server = args.llama_server
        if LLAMACPP in setups and not llama_server:
            llama_server = llamacpp.ensure_llamacpp(cache, say, rebuild=args.rebuild_llamacpp).binary
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not setups:
        print("error: no setup left to run", file=sys.stderr)
        return 2
    llamacpp_shape, cpu_features = None, None
    if LLAMACPP in setups:
        assert llama_server is not None  # ensure_llamacpp checked that it was built
        parallel, slot_context = llamacpp_slots(args, loads, scenario)
        llamacpp_shape = llamacpp.LlamaCppShape(llama_server, args.llamacpp_threads, parallel, slot_context)
        cpu_features = llamacpp.system_info(llama_server, str(gguf), args.llamacpp_threads)
        say(f"llamacpp: {parallel} slots of {slot_context} tokens, {args.llamacpp_threads} threads; "
            f"system_info: {cpu_features}")  # fmt: skip
    own_log_dir = args.log_dir is None
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-peers-")
    os.makedirs(os.path.join(log_dir, "results"), exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    peer_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    # VLLM_TARGET_DEVICE: vllm-cpu's client (`vllm bench serve`) does not find its CPU platform by
    # itself, and the generic one loads vllm._C, built for AVX512-BF16: SIGILL on an AVX2-only CPU.
    # The CPU platform loads the build that fits (_C_AVX2 / _C_AVX512 / _C).
    peer_env.update(VIRTUAL_ENV=venv.path, PATH=f"{os.path.join(venv.path, 'bin')}:{os.environ.get('PATH', '')}",
                    PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                    VLLM_TARGET_DEVICE="cpu")  # fmt: skip
    ctx = Context(args, venv, hf_dir, gguf, log_dir, env, peer_env, say, llamacpp_shape, guidellm)
    what = f"load points {[lp.name for lp in loads]}" if scenario is None else f"scenario {args.scenario}"
    say(f"{machine_line(machine)}; setups {setups}; {what}; {args.repeats} repeat(s); logs in {log_dir}")

    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the `with Supervisor` that stops the servers

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if in_main_thread else None
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    failed = False
    try:
        for repeat in range(args.repeats):  # repeat-major: drifting background load hits every setup
            for setup in setups:
                rows += run_setup(ctx, setup, repeat, loads, scenario)
    except Exception as exc:
        failed = True
        print(f"error: {exc}\n(logs in {log_dir})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        failed = True
        print(f"\ninterrupted; every server stopped (logs in {log_dir})", file=sys.stderr)
        return 130
    except BaseException:  # SystemExit from SIGTERM
        failed = True
        print(f"\nterminated; every server stopped (logs in {log_dir})", file=sys.stderr)
        raise
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)
        incomplete = failed or any(r["error"] or r["failed"] for r in rows)
        if own_log_dir and not incomplete:
            shutil.rmtree(log_dir, ignore_errors=True)

    if scenario is None:
        rows = add_peer_ratios(rows)
        print_repeat_tables(rows, machine_line(machine))
        spreads = spread_by_load(rows)
        print_spread(spreads, args.repeats)
        slo_rates = sustained_rates(rows)
        print_sustained_rates(slo_rates)
    else:
        slo_rates = []
        rows = add_ratios(rows, ratios_of=long_report.RATIOS)
        rows = add_ratios(rows, baseline=LLAMACPP, ratios_of=long_report.LLAMACPP_RATIOS)
        spreads = spread_by_load(rows, long_report.SPREAD_METRICS)
        long_report.print_long_tables(rows, spreads, machine_line(machine), scenario.slo)
    wall_s = time.monotonic() - started
    print(f"wall time {wall_s:.0f}s")
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "log_dir")}
    payload = {
        "config": {
            **config,
            "setups": setups,
            "load_points": [vars(lp) for lp in loads],
            "scenario_long": scenario.config() if scenario else None,
        },
        "machine": {**machine, "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "versions": {
            "pdserve": git_commit(),
            "vllm": venv.version(),
            "peer_venv": venv.path,
            **(llamacpp.versions(llamacpp_shape, cpu_features) if llamacpp_shape else {}),
        },
        "peer_model_dir": hf_dir,
        "client": (
            f"guidellm run ({GUIDELLM_SPEC}: synthetic_text, /v1/completions)"
            if guidellm
            else "vllm bench serve --backend openai --dataset-name random (side venv)"
        )  # fmt: skip
        + ("; two at once: streams and long prompts" if scenario else ""),
        "wall_s": wall_s,
        "rows": rows,
        "spread": spreads,
        "slo_rates": slo_rates if scenario is None else None,
    }
    json_path = args.json or default_path("peers" if scenario is None else "peers_long", "json")
    save_json(json_path, payload)
    plot_path = args.plot or os.path.splitext(json_path)[0] + ".png"
    if scenario is None:
        plot(spreads, loads, setups, plot_path)
    else:
        long_report.plot_long(rows, spreads, setups, scenario.slo, plot_path)
    if incomplete:
        print(f"some requests failed (logs in {log_dir})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
