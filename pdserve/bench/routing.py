"""``pdserve bench routing``: how well each routing policy uses the engines' prefix caches.

A 2-prefill + 2-decode cluster (``LocalCluster``, every engine publishing KV-cache events so
that each request's metrics carry the engines' own hit counts) runs one shared-prefix workload
per policy (``round_robin``, ``prefix``, ``kv``), each on fresh processes:

- ``--tenants`` tenants, each with a long system prompt (``--system-len`` tokens);
- ``--users`` users per tenant, each with a context of their own (``--user-len`` tokens) that
  follows the system prompt in every request of theirs;
- ``--requests`` requests, each a seeded random (tenant, user) plus a fresh question
  (``--question-len`` tokens), sent by ``--concurrency`` clients in a closed loop; every
  policy gets the same requests in the same order;
- traffic that shifts: the requests come in ``--phases`` stretches, and in each only a seeded
  draw of ``--active-tenants`` tenants asks (``--phases 1 --active-tenants 0``: every tenant
  all the time).

The engines' caches are sized (``--num-blocks``) so that a phase's tenants' system prompts fit
in the pool but not on one engine (the defaults: 8 tenants, 4 asking per phase, 20-block system
prompts, 56 blocks an engine: about two tenants each). A tenant idle for a phase is evicted;
whether the router learns that (``kv``, from ``BlockRemoved``) or keeps sending the tenant where
it first went (``prefix``) decides the hit rate. With every tenant asking all the time and
``--num-blocks 96`` every placement churns (4 tenants an engine need about 100 blocks) and the
two tie within noise on hit rate. Per policy and repeat it reports, from the engines' own counts:

- prefill prefix-hit rate: prompt tokens the prefill engine found in its cache / prompt tokens;
- blocks pulled per request: KV blocks the decode engine pulled from prefill (the ones its own
  cache did not hold);
- TTFT p50 (the router's clock) and handover p50 (prefill's first token to decode's first
  token: decode queueing + the pull + one step);
- how often the router's expected hit differed from the engines' (``expected == hit``).

``--repeats N`` runs every policy N times (interleaved; fresh seeded workload per repeat). The
verdict says whether ``kv`` beat ``prefix`` on hit rate and on blocks pulled in every repeat.
The model defaults to the synthetic tiny one (``--model tiny``): this measures routing, not
compute; ``--model bundled`` or a path runs a real one.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pdserve.bench.common.report import default_path, new_figure, print_table, save_figure, save_json
from pdserve.bench.common.stats import percentile

POLICIES = ("round_robin", "prefix", "kv")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Tenants with a system prompt each, users with a context each, and requests that share
    both, asked by a few tenants at a time (see the module docstring)."""

    tenants: int
    users: int
    system_len: int
    user_len: int
    question_len: int
    requests: int
    seed: int
    phases: int = 1
    active_tenants: int = 0  # tenants asking in each phase (0: all of them)

    def prompts(self) -> list[tuple[int, list[int]]]:
        """[(tenant, prompt token ids)]: the same list for every policy of a repeat.

        The requests come in ``phases`` consecutive stretches; in each, only a seeded draw of
        ``active_tenants`` tenants asks (traffic shifting between tenants over a day). A tenant
        idle for a phase is evicted, so where it was sent before says little about where its
        blocks are when it comes back."""
        rng = random.Random(self.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, 250) for _ in range(n)]

        systems = [tokens(self.system_len) for _ in range(self.tenants)]
        users = [[tokens(self.user_len) for _ in range(self.users)] for _ in range(self.tenants)]
        active = self.active_tenants or self.tenants
        # All tenants: no draw, so a run without phases makes the requests earlier runs did.
        phase_tenants = [
            sorted(rng.sample(range(self.tenants), active))
            if active < self.tenants
            else list(range(self.tenants))
            for _ in range(self.phases)
        ]
        out = []
        for i in range(self.requests):
            tenants = phase_tenants[i * self.phases // self.requests]
            tenant = tenants[rng.randrange(len(tenants))]
            user = rng.randrange(self.users)
            out.append((tenant, systems[tenant] + users[tenant][user] + tokens(self.question_len)))
        return out


def run_policy(
    policy: str, workload: SharedPrefixWorkload, args: argparse.Namespace, model: str | None, log_dir: str
) -> dict[str, Any]:
    """One policy on a fresh cluster: every request's router metrics, summarized."""
    from pdserve.client import Client
    from pdserve.cluster import LocalCluster

    engine_args = [
        "--num-blocks", str(args.num_blocks), "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "2048", "--max-num-batched-tokens", "1024",
    ]  # fmt: skip
    prompts = workload.prompts()
    with (
        LocalCluster(
            2,
            2,
            model=model,
            kv_events=True,
            policy=policy,
            engine_args=engine_args,
            router_args=["--disagg-min-tokens", "0", "--kv-load-weight", str(args.kv_load_weight)],
            log_dir=os.path.join(log_dir, policy),
        ) as cluster,
        Client(cluster.router_address) as client,
    ):
        time.sleep(2.0)  # the router's event streams come in sync within a health check or two
        started = time.perf_counter()
        next_index = iter(range(len(prompts)))
        results: list[dict[str, Any] | None] = [None] * len(prompts)

        def worker() -> None:
            for i in next_index:
                completion = client.generate(
                    prompt_token_ids=prompts[i][1], max_tokens=args.output_len, ignore_eos=True, timeout=120
                )
                results[i] = completion.metrics

        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            for future in [pool.submit(worker) for _ in range(args.concurrency)]:
                future.result()
        elapsed = time.perf_counter() - started
    metrics = [m for m in results if m is not None]
    prompt_tokens = sum(m["num_prompt_tokens"] for m in metrics)
    hit_tokens = sum(m["prefill_hit_blocks"] * BLOCK_SIZE for m in metrics)
    mismatched = sum(
        m[f"expected_{role}_hit_blocks"] != m[f"{role}_hit_blocks"]
        for m in metrics
        for role in ("prefill", "decode")
    )
    return {
        "policy": policy,
        "requests": len(metrics),
        "seconds": elapsed,
        "prefill_hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "pulled_blocks_per_req": statistics.mean(m["decode_pulled_blocks"] for m in metrics),
        "decode_hit_blocks_per_req": statistics.mean(m["decode_hit_blocks"] for m in metrics),
        "ttft_p50_ms": percentile([m["ttft_ms"] for m in metrics], 50),
        "handover_p50_ms": percentile([m["transfer_ms"] for m in metrics if m["transfer_ms"] > 0], 50),
        "expectation_misses": mismatched,
        "prefill_engines": _share(metrics, "prefill_engine"),
        "decode_engines": _share(metrics, "decode_engine"),
        "tenant_homes": tenant_homes(
            [(prompts[i][0], m["prefill_engine"]) for i, m in enumerate(results) if m is not None]
        ),
    }


def tenant_homes(served: list[tuple[int, str]]) -> list[int]:
    """How many tenants each prefill engine is home to (serves most of their requests), most
    first: [2, 2] is 4 tenants split evenly, [3, 1] a split that overloads one engine's cache."""
    by_tenant: dict[int, dict[str, int]] = {}
    for tenant, engine in served:
        counts = by_tenant.setdefault(tenant, {})
        counts[engine] = counts.get(engine, 0) + 1
    homes: dict[str, int] = {}
    for counts in by_tenant.values():
        home = max(sorted(counts), key=lambda engine: counts[engine])
        homes[home] = homes.get(home, 0) + 1
    return sorted(homes.values(), reverse=True)


def _share(metrics: list[dict[str, Any]], key: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in metrics:
        counts[m[key]] = counts.get(m[key], 0) + 1
    return dict(sorted(counts.items()))


def verdict(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """kv against prefix, repeat by repeat: higher hit rate, fewer blocks pulled, every time."""
    by = {(r["repeat"], r["policy"]): r for r in rows}
    repeats = sorted({r["repeat"] for r in rows})
    pairs = [(by[(k, "kv")], by[(k, "prefix")]) for k in repeats if (k, "kv") in by and (k, "prefix") in by]
    return {
        "kv_beats_prefix_on_hit_rate_every_repeat": bool(pairs)
        and all(kv["prefill_hit_rate"] > prefix["prefill_hit_rate"] for kv, prefix in pairs),
        "kv_beats_prefix_on_blocks_pulled_every_repeat": bool(pairs)
        and all(kv["pulled_blocks_per_req"] < prefix["pulled_blocks_per_req"] for kv, prefix in pairs),
    }


def plot(rows: list[dict[str, Any]], path: str) -> None:
    fig, axes = new_figure(1, 4, figsize=(16, 3.8))
    metrics = [
        ("prefill_hit_rate", "prefill prefix-hit rate"),
        ("pulled_blocks_per_req", "blocks pulled / request"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("handover_p50_ms", "handover p50 (ms)"),
    ]
    repeats = sorted({r["repeat"] for r in rows})
    width = 0.8 / max(1, len(repeats))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for j, repeat in enumerate(repeats):
            values = [
                next((r[key] or 0 for r in rows if r["policy"] == p and r["repeat"] == repeat), 0)
                for p in POLICIES
            ]
            ax.bar([i + j * width for i in range(len(POLICIES))], values, width, label=f"repeat {repeat}")
        ax.set_xticks([i + width * (len(repeats) - 1) / 2 for i in range(len(POLICIES))])
        ax.set_xticklabels(POLICIES)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, run in this order")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="tiny (synthetic, the default), bundled, or a path")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--users", type=int, default=16, help="users per tenant")
    parser.add_argument("--system-len", type=int, default=320, help="tokens of each tenant's system prompt")
    parser.add_argument("--user-len", type=int, default=48, help="tokens of each user's own context")
    parser.add_argument("--question-len", type=int, default=24, help="fresh tokens per request")
    parser.add_argument(
        "--phases", type=int, default=4, help="stretches of requests, each with its own tenants"
    )
    parser.add_argument("--active-tenants", type=int, default=4, help="tenants asking per phase (0: all)")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=56, help="KV blocks per engine (16 tokens each)")
    parser.add_argument("--kv-load-weight", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help=f"default: {default_path('routing', 'json')}")
    parser.add_argument("--plot", default=None, help=f"default: {default_path('routing', 'png')}")
    return parser


def main(argv: list[str] | None = None) -> int:
    from pdserve.bench.common.machine import machine_info

    args = build_parser().parse_args(argv)
    if not 1 <= args.phases <= args.requests or not 0 <= args.active_tenants <= args.tenants:
        print(
            f"error: need 1 <= --phases ({args.phases}) <= --requests ({args.requests}) and "
            f"0 <= --active-tenants ({args.active_tenants}) <= --tenants ({args.tenants})"
        )
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        print(f"error: unknown policies {unknown}; choose from {POLICIES}")
        return 2
    machine = machine_info()
    flags = " ".join(f"{flag}={int(present)}" for flag, present in machine["cpu_flags"].items())
    print(f"machine: {machine['cpu_model']}, nproc {machine['nproc']}, lscpu flags: {flags}")
    log_dir = tempfile.mkdtemp(prefix="pdserve-bench-routing-")
    model: str | None
    if args.model == "tiny":
        from pdserve.engine.model.tiny import write_tiny_model

        model = write_tiny_model(os.path.join(log_dir, "tiny-model"), seed=0)
    else:
        model = None if args.model == "bundled" else args.model
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        workload = SharedPrefixWorkload(
            args.tenants, args.users, args.system_len, args.user_len, args.question_len, args.requests,
            seed=args.seed + repeat, phases=args.phases, active_tenants=args.active_tenants,
        )  # fmt: skip
        for policy in policies:
            print(f"repeat {repeat}: {policy} ...", flush=True)
            row = run_policy(policy, workload, args, model, os.path.join(log_dir, f"repeat{repeat}"))
            row["repeat"] = repeat
            rows.append(row)
    columns = [
        "repeat", "policy", "requests", "prefill_hit_rate", "pulled_blocks_per_req", "decode_hit_blocks_per_req",
        "ttft_p50_ms", "handover_p50_ms", "expectation_misses",
    ]  # fmt: skip
    print_table("bench routing: 2 prefill + 2 decode, shared-prefix workload", rows, columns)
    for row in rows:
        print(
            f"repeat {row['repeat']} {row['policy']}: prefill {row['prefill_engines']} decode {row['decode_engines']}"
            f" tenants homed per prefill engine {row['tenant_homes']}"
        )
    result = verdict(rows)
    for claim, holds in result.items():
        print(f"{claim}: {holds}")
    print(f"logs in {log_dir}")
    payload = {"args": vars(args), "machine": machine, "rows": rows, "verdict": result}
    save_json(args.json or default_path("routing", "json"), payload)
    plot(rows, args.plot or default_path("routing", "png"))
    return 0
