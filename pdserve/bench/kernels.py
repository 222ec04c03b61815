"""``pdserve bench kernels``: how close each kernel gets to the bandwidth of the memory it reads.

Every kernel here is memory-bound at serving shapes (decode attention reads the whole context
once per step and does ~1 FLOP per byte; a decode matmul at a few rows reads each weight once),
so the honest yardstick is moving the same bytes, measured in the same run: a kernel at 80% of
that bandwidth is near its floor; one at 20% leaves time on the table.

The Triton kernels (the default) against a device-to-device copy, at SmolLM2-135M's shapes (30
layers, 9 query heads over 3 KV heads of dim 64, 16-token blocks) at a realistic batch. Before
measuring, it prints the bytes each kernel must move (its floor; the kernel may move more, e.g.
prefill re-reads K/V once per query tile) and the time that floor implies at a given bandwidth.
Without a GPU only that analysis is printed.

``--cpu``: the CPU block matmuls (``pdserve.kernels.cpu.quant``, bf16 x) at a 1B model's decode
shapes against a read of the same bytes (an int64 ``sum()`` over them). Each matrix is streamed
from DRAM: the pass cycles over distinct copies of it totalling ``--stream-mb``, far more than
the last-level cache.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from pdserve.bench.common.report import default_path, print_table, save_json


@dataclass(frozen=True)
class ModelShape:
    """The KV-cache-relevant shape of a model (defaults: SmolLM2-135M)."""

    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "bfloat16"

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    @property
    def kv_token_bytes(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """One block of all layers: what gather/scatter move per block id."""
        return self.num_layers * self.block_size * self.kv_token_bytes


@dataclass(frozen=True)
class KernelCall:
    """One kernel call at one shape, with the traffic and arithmetic it cannot avoid."""

    name: str
    shape: str
    bytes_moved: int  # reads + writes, each byte once
    flops: int

    def floor_us(self, bandwidth_gbs: float, tflops: float) -> float:
        """Lower bound on its time: the slower of moving its bytes and doing its FLOPs."""
        return max(self.memory_us(bandwidth_gbs), self.flops / (tflops * 1e6))

    def memory_us(self, bandwidth_gbs: float) -> float:
        return self.bytes_moved / (bandwidth_gbs * 1e3)


def kernel_calls(
    model: ModelShape, batch: int, context: int, prefill_seqs: int, chunk: int
) -> list[KernelCall]:
    """The per-layer kernel calls of a decode step, a chunked-prefill step, and one transfer."""
    item, m = model.itemsize, model
    q_bytes = m.num_heads * m.head_dim * item  # one token's query (and output) in one layer
    blocks_per_seq = math.ceil(context / m.block_size)
    prefill_tokens = prefill_seqs * chunk
    # Each prefill chunk is the last `chunk` tokens of a `context`-token sequence: token i of it
    # attends to context - chunk + i + 1 positions.
    visible = prefill_seqs * sum(context - chunk + i + 1 for i in range(chunk))
    table_bytes = blocks_per_seq * 4 + 4  # int32 block-table row + seq_len
    return [
        KernelCall(
            "reshape_and_cache",
            f"{batch} tok (decode)",
            batch * (2 * m.kv_token_bytes + 8),  # read K/V, write them, read the int64 slot
            0,
        ),
        KernelCall(
            "reshape_and_cache",
            f"{prefill_tokens} tok (prefill)",
            prefill_tokens * (2 * m.kv_token_bytes + 8),
            0,
        ),
        KernelCall(
            "paged_attention_decode",
            f"{batch} seqs x {context} ctx",
            # K/V are read once per KV head, shared by its query heads (GQA).
            batch * (context * m.kv_token_bytes + 2 * q_bytes + table_bytes),
            4 * batch * context * m.num_heads * m.head_dim,  # QK^T and PV, 2 FLOPs per MAC
        ),
        KernelCall(
            "paged_attention_prefill",
            f"{prefill_seqs} x last {chunk} of {context}",
            prefill_seqs * (context * m.kv_token_bytes + table_bytes + 4) + prefill_tokens * 2 * q_bytes,
            4 * visible * m.num_heads * m.head_dim,
        ),
        KernelCall(
            "gather_blocks",
            f"{blocks_per_seq} blocks ({context} tok)",
            blocks_per_seq * (2 * m.block_bytes + 8),
            0,
        ),
        KernelCall(
            "scatter_blocks",
            f"{blocks_per_seq} blocks ({context} tok)",
            blocks_per_seq * (2 * m.block_bytes + 8),
            0,
        ),
    ]


def _print_floors(model: ModelShape, loads: list[KernelCall], args: argparse.Namespace) -> list[dict]:
    rows = [
        {
            "kernel": w.name,
            "shape": w.shape,
            "MB moved": w.bytes_moved / 1e6,
            "GFLOP": w.flops / 1e9,
            "floor us": w.floor_us(args.bandwidth_gbs, args.tflops),
            "bound by": "memory"
            if w.floor_us(args.bandwidth_gbs, args.tflops) == w.memory_us(args.bandwidth_gbs)
            else "compute",
        }
        for w in loads
    ]
    print_table(
        f"What each call must move (attention, cache write: one layer; gather/scatter: all "
        f"{model.num_layers} layers) and its floor at {args.bandwidth_gbs:g} GB/s, {args.tflops:g} TFLOPS "
        f"[{model.dtype}, {model.num_heads}/{model.num_kv_heads} heads x {model.head_dim}, "
        f"block {model.block_size}]",
        rows,
        list(rows[0]),
    )
    step = [w for w in loads if w.shape.endswith("(decode)") or w.name == "paged_attention_decode"]
    step_bytes = model.num_layers * sum(w.bytes_moved for w in step)
    step_us = model.num_layers * sum(w.floor_us(args.bandwidth_gbs, args.tflops) for w in step)
    print(
        f"A decode step of {args.batch} x {args.context} tokens moves {step_bytes / 1e6:.1f} MB of KV "
        f"through these kernels ({model.num_layers} layers): >= {step_us / 1e3:.3f} ms at "
        f"{args.bandwidth_gbs:g} GB/s, i.e. <= {args.batch / (step_us / 1e6):,.0f} tokens/s from attention "
        "alone (weights and activations not counted)."
    )
    return rows


def _kernel_runs(
    model: ModelShape, args: argparse.Namespace, dev: torch.device
) -> dict[str, tuple[Callable[[], object], Callable[[], float]]]:
    """{workload key: (run the Triton kernel, its relative error vs the torch reference)}.

    Inputs live in one full-size cache (all layers) and attention reads a layer view of it, as
    the runner does; block tables are a random permutation, as after a while of serving.
    """
    from pdserve.kernels import reference
    from pdserve.kernels.triton import ops as triton_ops

    dtype = getattr(torch, model.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    blocks_per_seq = math.ceil(args.context / model.block_size)
    num_seqs = max(args.batch, args.prefill_seqs)
    num_blocks = num_seqs * blocks_per_seq + 1
    shape = (model.num_layers, 2, model.block_size, model.num_kv_heads, model.head_dim)
    kv_cache = torch.randn((num_blocks, *shape), generator=gen, device=dev, dtype=dtype)
    layer = kv_cache[:, 0]  # the strided layer view the runner passes
    tables = torch.randperm(num_blocks - 1, generator=gen, device=dev).view(num_seqs, -1).int()
    scale = model.head_dim**-0.5

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=dev, dtype=dtype)

    def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
        return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())

    runs: dict[str, tuple[Callable[[], object], Callable[[], float]]] = {}

    def add_cache_write(key_name: str, num_tokens: int) -> None:
        key, value = (
            randn(num_tokens, model.num_kv_heads, model.head_dim),
            randn(num_tokens, model.num_kv_heads, model.head_dim),
        )
        slots = torch.randperm((num_blocks - 1) * model.block_size, generator=gen, device=dev)[:num_tokens]

        def check() -> float:
            expected = layer.clone()
            reference.reshape_and_cache_ref(key, value, expected, slots)
            triton_ops.reshape_and_cache(key, value, layer, slots)
            return 0.0 if torch.equal(layer, expected) else math.inf

        runs[key_name] = (lambda: triton_ops.reshape_and_cache(key, value, layer, slots), check)

    add_cache_write("reshape_and_cache/decode", args.batch)
    add_cache_write("reshape_and_cache/prefill", args.prefill_seqs * args.chunk)

    query = randn(args.batch, model.num_heads, model.head_dim)
    seq_lens = torch.full((args.batch,), args.context, device=dev, dtype=torch.int32)
    dec_tables = tables[: args.batch]
    runs["paged_attention_decode"] = (
        lambda: triton_ops.paged_attention_decode(query, layer, dec_tables, seq_lens, scale),
        lambda: rel_err(
            triton_ops.paged_attention_decode(query, layer, dec_tables, seq_lens, scale),
            reference.paged_attention_decode_ref(query.float(), layer.float(), dec_tables, seq_lens, scale),
        ),
    )

    chunk_q = randn(args.prefill_seqs * args.chunk, model.num_heads, model.head_dim)
    qsl = torch.arange(args.prefill_seqs + 1, device=dev, dtype=torch.int32) * args.chunk
    pre_lens = torch.full((args.prefill_seqs,), args.context, device=dev, dtype=torch.int32)
    pre_tables = tables[: args.prefill_seqs]
    runs["paged_attention_prefill"] = (
        lambda: triton_ops.paged_attention_prefill(chunk_q, layer, pre_tables, qsl, pre_lens, scale),
        lambda: rel_err(
            triton_ops.paged_attention_prefill(chunk_q, layer, pre_tables, qsl, pre_lens, scale),
            reference.paged_attention_prefill_ref(
                chunk_q.float(), layer.float(), pre_tables, qsl, pre_lens, scale
            ),
        ),
    )

    ids = tables[0].long()
    packed = torch.empty((len(ids), *shape), device=dev, dtype=dtype)
    scatter_ids = tables[1].long()
    runs["gather_blocks"] = (
        lambda: triton_ops.gather_blocks(kv_cache, ids, packed),
        lambda: 0.0 if torch.equal(triton_ops.gather_blocks(kv_cache, ids), kv_cache[ids]) else math.inf,
    )

    def check_scatter() -> float:
        triton_ops.scatter_blocks(kv_cache, scatter_ids, packed)
        return 0.0 if torch.equal(kv_cache[scatter_ids], packed) else math.inf

    runs["scatter_blocks"] = (lambda: triton_ops.scatter_blocks(kv_cache, scatter_ids, packed), check_scatter)
    return runs


def _copy_ms(traffic_bytes: int, dev: torch.device, timer: Callable[[Callable[[], object]], float]) -> float:
    """Time of a device-to-device copy with the same traffic: it reads N bytes and writes N."""
    src = torch.empty(traffic_bytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def _measure(
    model: ModelShape,
    loads: list[KernelCall],
    args: argparse.Namespace,
    dev: torch.device,
    timer: Callable[[Callable[[], object]], float],  # fn -> milliseconds
) -> list[dict]:
    """Time each kernel and a copy of the same bytes; check each kernel against its reference."""
    runs = _kernel_runs(model, args, dev)
    keys = [
        "reshape_and_cache/decode",
        "reshape_and_cache/prefill",
        "paged_attention_decode",
        "paged_attention_prefill",
        "gather_blocks",
        "scatter_blocks",
    ]
    rows = []
    for key, load in zip(keys, loads, strict=True):
        run, check = runs[key]
        error = check()
        kernel_ms = timer(run)
        copy_ms = _copy_ms(load.bytes_moved, dev, timer)
        kernel_gbs = load.bytes_moved / (kernel_ms * 1e6)
        copy_gbs = load.bytes_moved / (copy_ms * 1e6)
        rows.append(
            {
                "kernel": load.name,
                "shape": load.shape,
                "MB moved": load.bytes_moved / 1e6,
                "kernel us": kernel_ms * 1e3,
                "kernel GB/s": kernel_gbs,
                "copy us": copy_ms * 1e3,
                "copy GB/s": copy_gbs,
                "kernel / copy": kernel_gbs / copy_gbs,
                "rel err vs ref": error,
            }
        )
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    print_table(
        f"Triton kernels vs a device-to-device copy of the same bytes ({device_name})", rows, list(rows[0])
    )
    return rows


# A 1B model's decode matmuls (Llama-3.2-1B: hidden 2048, MLP 8192) as {name: (K, N)}: x [M, K]
# against N rows of K weights.
CPU_SHAPES = {"gate_up": (2048, 8192), "down": (8192, 2048), "attn": (2048, 2048)}
# The kinds held as GGUF stores them, then the Q4_1 and Q8_0 routes (row-major and x16) beside them.
CPU_KINDS = ("Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q4_1_X16", "Q8_0", "Q8_0_X16")
# {kind: offsets of its fp16 scales in a block}: random bytes there could be inf or nan
_SCALE_OFFSETS = {"Q4_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
                  "Q8_0": (0,)}  # fmt: skip


def random_block_rows(kind_name: str, rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """``rows`` rows of random ``kind`` blocks, as the kernels hold them, with small finite scales."""
    from pdserve.kernels.cpu import quant

    kind = quant.BlockKind[kind_name]
    plain, rng = kind.plain, np.random.default_rng(seed)
    if plain is quant.BlockKind.Q4_1:  # [nibbles][d][m] per row
        nibbles = rng.integers(0, 256, (rows, in_features // 2), dtype=np.uint8)
        scales = rng.uniform(-0.01, 0.01, (rows, in_features // 16)).astype(np.float16).view(np.uint8)
        blocks = torch.from_numpy(np.concatenate([nibbles, scales], axis=1))
    else:
        count = rows * in_features // plain.block_weights
        raw = rng.integers(0, 256, (count, plain.block_bytes), dtype=np.uint8)
        for offset in _SCALE_OFFSETS[plain.name]:
            values = rng.uniform(-0.01, 0.01, count).astype(np.float16)
            raw[:, offset : offset + 2] = values.view(np.uint8).reshape(count, 2)
        blocks = torch.from_numpy(raw.reshape(rows, -1))
    return quant.interleave_rows(plain, blocks, in_features)[1] if kind.interleaved else blocks


def _pass_s(kind: int, x: torch.Tensor, pointers: list[int], out_features: int, threads: int) -> float:
    """Seconds a matrix of one pass of pd_quant_matmul (bf16 x and y, through ctypes) over the
    copies at ``pointers``."""
    from pdserve.kernels.cpu import quant

    lib, y = quant.library(), torch.empty(x.shape[0], out_features, dtype=torch.bfloat16)
    start = time.perf_counter()
    for pointer in pointers:
        lib.pd_quant_matmul(kind, x.data_ptr(), 1, x.shape[0], x.shape[1], pointer, out_features, y.data_ptr(), 1,
                            threads)  # fmt: skip
    return (time.perf_counter() - start) / len(pointers)


def _read_s(words: torch.Tensor, copies: int) -> float:
    """Seconds a matrix of an int64 sum() over all the copies: a read of every byte once."""
    start = time.perf_counter()
    words.sum()
    return (time.perf_counter() - start) / copies


def _measure_cpu_blocks(args: argparse.Namespace) -> list[dict]:
    """Per (shape, kind, batch): a pass over all copies of the matrix and a read of the same
    bytes, alternately, ``args.repeats`` times; the minimum (and the kernel's median) of each."""
    from pdserve.kernels.cpu import quant

    torch.set_num_threads(args.threads)
    quant.library()  # built before anything is timed
    rows = []
    for shape in args.shapes:
        in_features, out_features = CPU_SHAPES[shape]
        for kind_name in args.kinds:
            one = random_block_rows(kind_name, out_features, in_features)
            copies = max(2, math.ceil(args.stream_mb * 2**20 / one.numel()))
            weights = one.unsqueeze(0).expand(copies, *one.shape).contiguous()
            words = weights.view(-1).view(torch.int64)
            pointers = [weights[i].data_ptr() for i in range(copies)]
            kind = int(quant.BlockKind[kind_name])
            for batch in args.batches:
                x = torch.randn(batch, in_features, generator=torch.Generator().manual_seed(batch)).bfloat16()
                _pass_s(kind, x, pointers, out_features, args.threads)
                kernel_s, read_s = [], []
                for _ in range(args.repeats):
                    read_s.append(_read_s(words, copies))
                    kernel_s.append(_pass_s(kind, x, pointers, out_features, args.threads))
                rows.append(
                    {
                        "kind": kind_name,
                        "matrix": shape,
                        "K x N": f"{in_features}x{out_features}",
                        "batch": batch,
                        "weight MB": one.numel() / 1e6,
                        "read us": min(read_s) * 1e6,
                        "kernel us": min(kernel_s) * 1e6,
                        "kernel us median": statistics.median(kernel_s) * 1e6,
                        "GB/s": one.numel() / min(kernel_s) / 1e9,
                        "kernel / read": min(kernel_s) / min(read_s),
                    }
                )
    return rows


def _cpu_main(args: argparse.Namespace) -> int:
    from pdserve.bench.common.machine import git_commit, machine_info, machine_line

    machine = machine_info()
    rows = _measure_cpu_blocks(args)
    print_table(
        f"CPU block matmuls, bf16 x, {args.threads} thread(s), streamed from DRAM ({args.stream_mb} MB of copies), "
        f"against an int64 sum() of the same bytes; min of {args.repeats} [{machine_line(machine)}]",
        rows,
        list(rows[0]),
    )
    save_json(
        args.out or default_path("kernels_cpu", "json"),
        {"machine": machine, "commit": git_commit(), "args": vars(args), "measured": rows},
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench kernels", description=__doc__)
    parser.add_argument(
        "--cpu", action="store_true", help="the CPU block matmuls instead of the Triton kernels"
    )
    parser.add_argument("--kinds", nargs="+", default=list(CPU_KINDS), choices=CPU_KINDS, help="(--cpu)")
    parser.add_argument(
        "--shapes", nargs="+", default=list(CPU_SHAPES), choices=list(CPU_SHAPES), help="(--cpu)"
    )
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8], help="(--cpu) rows of x")
    parser.add_argument("--threads", type=int, default=1, help="(--cpu)")
    parser.add_argument("--repeats", type=int, default=7, help="(--cpu) passes over the copies, each timed")
    parser.add_argument("--stream-mb", type=int, default=256, help="(--cpu) the copies of each matrix, in MB")
    parser.add_argument("--batch", type=int, default=32, help="decode sequences per step")
    parser.add_argument("--context", type=int, default=1024, help="context length of every sequence")
    parser.add_argument("--prefill-seqs", type=int, default=4, help="prefill chunks per step")
    parser.add_argument("--chunk", type=int, default=512, help="query tokens per prefill chunk")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bandwidth-gbs", type=float, default=1000.0, help="for the floors (A100: ~1500)")
    parser.add_argument("--tflops", type=float, default=100.0, help="for the prefill compute floor")
    parser.add_argument("--warmup-ms", type=int, default=25)
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument(
        "--out", default=None, help="JSON path (default: bench-results/kernels.json, or kernels_cpu.json)"
    )
    args = parser.parse_args(argv)
    if args.cpu:
        return _cpu_main(args)
    if args.chunk > args.context:
        parser.error("--chunk must be <= --context")

    model = ModelShape(dtype=args.dtype)
    loads = kernel_calls(model, args.batch, args.context, args.prefill_seqs, args.chunk)
    floors = _print_floors(model, loads, args)
    if not torch.cuda.is_available():
        print("pdserve bench kernels: measuring the Triton kernels needs a CUDA GPU; none found.")
        return 0
    from triton.testing import do_bench  # flushes L2 between runs; median of CUDA-event timings

    measured = _measure(
        model,
        loads,
        args,
        torch.device("cuda"),
        lambda fn: do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"),
    )
    save_json(
        args.out or default_path("kernels", "json"),
        {"model": asdict(model), "args": vars(args), "floors": floors, "measured": measured},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
