"""``pdserve bench step``: one decode step against its floor, and where the rest goes.

A decode step at small batch reads every weight once, so its floor is the bytes of the weights
it reads divided by the memory bandwidth of the cores it runs on. This benchmark measures both
in the same run and splits the measured step into what explains it:

- ``bandwidth``: a ``sum()`` over 512 MB on this process's torch threads, before every repeat
  of the steps, the median (the floor's denominator; 24-26 GB/s on one core of the AMD EPYC
  here; on a shared VM it moves between minutes, so it is read beside the steps it explains);
- ``weight MB``: the decoder projections, the norms and the LM head as the engine holds them
  (bf16 projections packed for oneDNN read the same bytes as plain bf16; ``--quantization gguf``
  reads the file's blocks: 5 bits a weight for Q4_1, 8.5 for the Q8_0 head);
- ``step``: the median decode step of the real engine (``pdserve.LLM``, the runner, the
  scheduler, sampling) at each batch size, every sequence at the same context length;
- ``matmuls``: the same projections and LM head called alone on a batch of that size, in
  layer order, as the step calls them: the part the floor describes;
- ``attention``: the paged decode attention of every layer over the same block tables;
- ``other``: the rest of the step (norms, RoPE, activations, residuals, the KV write, the
  runner's metadata, sampling, Python).

``step / floor`` is how far a configuration is from the weights' memory traffic;
``matmuls / floor`` how far the GEMMs alone are.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm import tqdm

from pdserve.bench.common.report import default_path, new_figure, print_table, save_figure, save_json
from pdserve.config import QUANTIZATION_CHOICES
from pdserve.engine.cpu_resources import cpu_flags, has_native_bf16
from pdserve.engine.model.layers.linear import PackedLinear
from pdserve.engine.model.layers.quant_linear import QuantLinear

if TYPE_CHECKING:
    from pdserve.engine.model.llama import LlamaForCausalLM
    from pdserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
    from pdserve.engine.runner import ModelRunner

BANDWIDTH_BYTES = 512 * 1024 * 1024


def memory_bandwidth_gbs(repeats: int = 5, data: torch.Tensor | None = None) -> float:
    """GB/s of a ``sum()`` over 512 MB of float32 (best of ``repeats``): streaming reads.
    ``data``: the 512 MB to read (allocated here if None)."""
    if data is None:
        data = torch.ones(BANDWIDTH_BYTES // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BYTES / best / 1e9


def _best_of(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a decode step reads: every layer's projections and norms, the final norm, the LM
    head (the embedding rows it looks up are negligible)."""
    from pdserve.engine.model.layers.norm import RMSNorm

    itemsize = model.model.norm.weight.element_size()

    def read_bytes(proj: nn.Linear | PackedLinear | QuantLinear) -> int:
        if isinstance(proj, QuantLinear):
            return sum(blocks.numel() for _, blocks in proj.parts)
        return proj.in_features * proj.out_features * itemsize

    total = sum(read_bytes(p) for p in _projections(model))
    for module in model.modules():
        if isinstance(module, RMSNorm):
            total += module.weight.numel() * module.weight.element_size()
    if model.quant_lm_head is not None:
        return total + read_bytes(model.quant_lm_head)
    head = model.lm_head if model.lm_head is not None else model.model.embed_tokens
    return total + head.weight.numel() * head.weight.element_size()


def _projections(model: LlamaForCausalLM) -> list[nn.Linear | PackedLinear | QuantLinear]:
    """Every decoder projection, in the order a step runs them (every family's layer has the
    same four: fused q/k/v, o, fused gate/up, down)."""
    out: list[nn.Linear | PackedLinear | QuantLinear] = []
    layers: list[Any] = list(model.model.layers)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            assert isinstance(proj, nn.Linear | PackedLinear | QuantLinear)
            out.append(proj)
    return out


def time_matmuls(net: LlamaForCausalLM, batch: int, repeats: int) -> float:
    """Seconds for every projection and the LM head on ``batch`` rows, in layer order."""
    projections = _projections(net)
    dtype = net.dtype
    inputs = {p.in_features: torch.randn(batch, p.in_features, dtype=dtype) for p in projections}
    head_in = torch.randn(batch, net.config.hidden_size, dtype=dtype)

    def matmuls() -> None:
        for proj in projections:
            proj(inputs[proj.in_features])
        net.compute_logits(head_in)

    with torch.inference_mode():
        return _best_of(matmuls, repeats)


def time_attention(runner: ModelRunner, batch: int, context: int, repeats: int) -> float:
    """Seconds for every layer's paged decode attention of ``batch`` sequences of ``context``."""
    from pdserve.kernels import paged_attention_decode

    config = runner.model.config
    blocks = -(-context // runner.block_size)
    tables = torch.arange(batch * blocks, dtype=torch.int32).reshape(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, config.num_heads, config.head_dim, dtype=runner.kv_cache.dtype)
    scale = config.head_dim**-0.5

    def attention() -> None:
        for index in range(config.num_layers):
            paged_attention_decode(query, runner.kv_cache[:, index], tables, lens, scale)

    with torch.inference_mode():
        return _best_of(attention, repeats)


def measure(
    dtype: str,
    quantization: str,
    batch_sizes: list[int],
    context: int,
    decode_tokens: int,
    repeats: int,
    model: str | None,
) -> list[dict]:
    """One row per batch size for one dtype and quantization (see the module docstring)."""
    from pdserve import LLM
    from pdserve.engine.request import SamplingParams

    llm = LLM(
        model,
        dtype=dtype,
        quantization=quantization,
        max_model_len=4096,
        num_blocks=4096,
        enable_prefix_caching=False,
    )
    net = llm.engine.runner.model
    runner = llm.engine.runner
    nbytes = weight_bytes(net)
    # The rate memory is read at changes from minute to minute on a shared VM (8.5 or 14 ms for
    # the same 667 MB, minutes apart): it is measured before every repeat of the steps it is the
    # floor of, and the floor is their median.
    bandwidth_data = torch.ones(BANDWIDTH_BYTES // 4)
    step_times: list[float] = []
    execute = runner.execute_model

    def timed_execute(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        out = execute(scheduler_output)
        if scheduler_output.num_scheduled_tokens and all(
            n == 1 for n in scheduler_output.num_scheduled_tokens.values()
        ):
            step_times.append(time.perf_counter() - start)
        return out

    runner.execute_model = timed_execute  # type: ignore[method-assign]
    vocab = llm.engine.vocab_size
    rows = []
    for batch in batch_sizes:
        generator = torch.Generator().manual_seed(batch)
        prompts = torch.randint(100, vocab, (batch, context), generator=generator).tolist()
        params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        step_times.clear()
        bandwidths = []
        for _ in range(repeats):
            bandwidths.append(memory_bandwidth_gbs(3, bandwidth_data))
            llm.generate(prompts, params)
        step_s = statistics.median(step_times)
        bandwidth = statistics.median(bandwidths)
        floor_s = nbytes / (bandwidth * 1e9)

        matmul_s = time_matmuls(net, batch, repeats * 3)
        attention_s = time_attention(runner, batch, context + decode_tokens // 2, repeats * 3)
        rows.append(
            {
                "dtype": dtype,
                "quantization": quantization,
                "batch": batch,
                "context": context,
                "weight_mb": nbytes / 1e6,
                "bandwidth_gbs": bandwidth,
                "floor_ms": floor_s * 1e3,
                "step_ms": step_s * 1e3,
                "step_over_floor": step_s / floor_s,
                "matmuls_ms": matmul_s * 1e3,
                "matmuls_over_floor": matmul_s / floor_s,
                "attention_ms": attention_s * 1e3,
                "other_ms": (step_s - matmul_s - attention_s) * 1e3,
                "tok_s": batch / step_s,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench step", description=__doc__)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        help="default: float32, plus bfloat16 where the CPU has native bf16",
    )
    parser.add_argument(
        "--quantizations",
        nargs="+",
        default=None,
        choices=[q for q in QUANTIZATION_CHOICES if q != "auto"],
        help="default: none, plus gguf when the model is a GGUF file (the bundled one is)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=256, help="prompt tokens of every sequence")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (one core: as an engine of the cluster)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    flags = cpu_flags()
    dtypes = args.dtypes or (["float32", "bfloat16"] if has_native_bf16(flags) else ["float32"])
    is_gguf = args.model is None or str(args.model).endswith(".gguf")
    quantizations = args.quantizations or (["none", "gguf"] if is_gguf else ["none"])
    configs = [(dtype, quantization) for quantization in quantizations for dtype in dtypes]
    rows: list[dict] = []
    for dtype, quantization in tqdm(configs, desc="bench step", unit="config"):
        rows += measure(
            dtype, quantization, args.batch_sizes, args.context, args.decode_tokens, args.repeats, args.model
        )
    print_table(
        f"decode step vs its floor ({args.threads} thread(s), context {args.context})",
        rows,
        ["dtype", "quantization", "batch", "weight_mb", "bandwidth_gbs", "floor_ms", "step_ms", "step_over_floor",
         "matmuls_ms", "matmuls_over_floor", "attention_ms", "other_ms", "tok_s"],
    )  # fmt: skip
    cpu_bits = sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx512f", "avx2"))
    payload = {"threads": args.threads, "cpu_flags": cpu_bits, "model": args.model or "bundled", "rows": rows}
    save_json(args.json or default_path("step", "json"), payload)
    _plot(rows, args.plot or default_path("step", "png"))
    return 0


def _plot(rows: list[dict], path: str) -> None:
    fig, ax = new_figure(figsize=(7, 4))
    labels = [f"{r['dtype']}/{r.get('quantization', 'none')}\nbatch {r['batch']}" for r in rows]
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for part in ("matmuls_ms", "attention_ms", "other_ms"):
        values = [max(0.0, r[part]) for r in rows]
        ax.bar(xs, values, bottom=bottom, label=part.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.scatter(xs, [r["floor_ms"] for r in rows], color="black", marker="_", s=600, label="floor", zorder=3)
    ax.set_xticks(xs, labels)
    ax.set_ylabel("ms per decode step")
    ax.set_title("decode step: where the time goes, against the weights' floor")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
