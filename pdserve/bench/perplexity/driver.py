"""``pdserve bench perplexity``: each model file's perplexity in pdserve against llama.cpp's
``llama-perplexity`` on the same file, text, tokens, chunks and scored positions (issue 41).

For each ``--model`` (a ``pdserve bench models`` name, ``bundled``, or a path), in turn:

1. the text's token ids from pdserve's tokenizer, compared with ``llama-tokenize``'s (where they
   differ, pdserve is scored on llama.cpp's ids and the row says so, so the difference left is
   numeric);
2. ``llama-perplexity -c CTX`` on the file (its ``Final estimate``, with its ``+/-``);
3. pdserve in the compared mode (``--dtype float32 --quantization none``: dense fp32 weights
   dequantized from the file's blocks) over llama.cpp's chunks (``scheme``): PASS when its
   perplexity is within ``--bound`` (0.3%) of llama.cpp's;
4. pdserve as it serves by default (``--dtype auto --quantization auto``: bf16 on a CPU with
   native bf16, the file's own blocks), for information (``--no-default`` skips it);
5. with ``--llamacpp-f32``, ``llama-perplexity`` again on a float32 copy of the file with float32
   attention and KV cache (``llamacpp_run``): what is left between this and pdserve's float32 run
   is pdserve's own error, while step 2 also holds llama.cpp's rounding (8-bit activations in its
   block dot products, an f16 KV cache).

One model is loaded at a time, and each run is alone on the cores (``--threads``, both sides).
The exit status is 1 when a model misses the bound. About a minute for a 135M model on 2 cores
(ctx 512, the 7 chunks of ``tests/data/quality_text.txt``), several for the 1B-shaped one in fp32.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.common.report import default_path, print_table, save_json
from pdserve.bench.models.paths import CACHE_ENV, model_path
from pdserve.bench.models.recipes import RECIPES
from pdserve.bench.peers import side_venv
from pdserve.bench.perplexity import llamacpp_run, pdserve_run, report
from pdserve.bench.perplexity.scheme import Chunking, plan, text_as_llamacpp_reads_it
from pdserve.config import DTYPE_CHOICES, QUANTIZATION_CHOICES, ModelConfig

BUNDLED = "bundled"
DEFAULT_MODELS = ("smollm2-135m-q4_k_m", "smollm2-135m-q6_k", "llama-1b-shaped-q4_k_m", "gemma3-270m-q4_k_m",
                  BUNDLED)  # fmt: skip
DEFAULT_TEXT = Path(__file__).resolve().parents[3] / "tests" / "data" / "quality_text.txt"
DEFAULT_BOUND = 0.003  # issue 41: within 0.3% of llama.cpp's


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench perplexity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", action="append", default=None, metavar="NAME_OR_PATH",
                   help=f"a `pdserve bench models` name ({', '.join(RECIPES)}), '{BUNDLED}' or a GGUF path; "
                        f"repeatable (default: {' '.join(DEFAULT_MODELS)})")  # fmt: skip
    p.add_argument("--ctx", type=int, default=512, help="tokens a chunk (llama-perplexity -c; default 512)")
    p.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: all)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="the text file (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="pdserve's compared mode")
    p.add_argument(
        "--quantization", default="none", choices=QUANTIZATION_CHOICES, help="pdserve's compared mode"
    )
    p.add_argument("--no-default", action="store_true", help="skip pdserve's default mode (auto/auto)")
    p.add_argument("--forward-tokens", type=int, default=None,
                   help="pdserve scores a chunk in forward passes of this many tokens (16: the decode "
                        "kernels run, as a decode step's; needed to measure -a8 modes; default: one pass)")  # fmt: skip
    p.add_argument("--no-llamacpp", action="store_true", help="pdserve only (no llama.cpp build needed)")
    p.add_argument("--llamacpp-f32", action="store_true",
                   help="also llama.cpp on a float32 copy of each file, with f32 attention and KV cache")  # fmt: skip
    p.add_argument("--llamacpp-arg", action="append", default=[], metavar="ARG",
                   help="one more argument to llama-perplexity, repeatable (--llamacpp-arg=-ctk ...)")  # fmt: skip
    p.add_argument("--bound", type=float, default=DEFAULT_BOUND, help="relative PPL bound (default 0.003)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="both sides' threads")
    p.add_argument(
        "--cache", default=None, help=f"the model cache (default: ${CACHE_ENV}, else ~/.cache/pdserve/models)"
    )
    p.add_argument(
        "--peer-cache", default=None, help="where llama.cpp is built (default: ~/.cache/pdserve/peers)"
    )
    p.add_argument("--json", default=None, help="default: bench-results/perplexity.json")
    p.add_argument("--plot", default=None, help="default: bench-results/perplexity.png")
    return p


def say(message: str) -> None:
    print(f"[bench perplexity] {message}", file=sys.stderr, flush=True)


def resolve_model(name: str, cache: str | None) -> str:
    """The file of ``name``: a ``pdserve bench models`` name, ``bundled``, or a path."""
    if name == BUNDLED:
        from pdserve.engine.model.loader import bundled_model_path

        return bundled_model_path()
    if name in RECIPES:
        return model_path(name, cache)
    path = os.path.abspath(os.path.expanduser(name))
    if not os.path.exists(path):
        raise FileNotFoundError(f"--model {name}: neither a file nor one of {BUNDLED}, {', '.join(RECIPES)}")
    return path


@dataclass(frozen=True)
class PdserveRun:
    """One pdserve mode's perplexity over the chunks, and its times."""

    dtype: str
    quantization: str
    weights: str  # what the weights are held as (``Q4_K x.., float32``)
    ppl: float
    error: float
    chunk_ppls: list[float]
    load_seconds: float
    eval_seconds: float


def run_pdserve(
    path: str,
    dtype: str,
    quantization: str,
    ids: list[int],
    chunking: Chunking,
    forward_tokens: int | None = None,
) -> PdserveRun:
    """Load ``path`` in this mode, score the chunks, and let the model go."""
    from pdserve.engine.model.loader import load_served_model

    start = time.perf_counter()
    loaded = load_served_model(ModelConfig(path=path, dtype=dtype, quantization=quantization))
    loaded_at = time.perf_counter()
    mode, weights = str(loaded.dtype).removeprefix("torch."), loaded.weights
    say(f"pdserve {mode} {loaded.quantization} ({weights}): loaded in {loaded_at - start:.1f}s")
    tally = pdserve_run.evaluate(loaded, ids, chunking, say, forward_tokens)
    done = time.perf_counter()
    ppl, error = tally.estimate()
    say(f"pdserve {mode} {loaded.quantization}: PPL = {ppl:.4f} +/- {error:.5f} ({done - loaded_at:.1f}s)")
    quant = loaded.quantization
    del loaded
    gc.collect()
    return PdserveRun(mode, quant, weights, ppl, error, tally.chunk_ppls, loaded_at - start, done - loaded_at)


def measure_model(
    name: str, args: argparse.Namespace, text: str, tools: llamacpp_run.Tools | None
) -> dict[str, Any]:
    """One row of the report: the file's ids, llama.cpp's run and pdserve's (see the module doc)."""
    from pdserve.engine.model.loader import load_tokenizer

    path = resolve_model(name, args.cache)
    say(f"{name}: {path}")
    tokenizer = load_tokenizer(path)
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id if pdserve_run.adds_bos(tokenizer) else None
    row: dict[str, Any] = {"model": name, "path": path, "file_bytes": os.path.getsize(path), "bos_id": bos}
    if tools is not None and not path.endswith(".gguf"):
        say(f"{name}: not a GGUF file, so no llama.cpp run")
    with_llamacpp = tools is not None and path.endswith(".gguf")
    if with_llamacpp:
        assert tools is not None
        theirs = llamacpp_run.tokenize(tools, path, text)
        row["ids_match"] = theirs == ids
        if theirs != ids:
            first_diff = next((i for i, (a, b) in enumerate(zip(ids, theirs, strict=False)) if a != b),
                              min(len(ids), len(theirs)))  # fmt: skip
            row["ids_first_difference"] = first_diff
            say(f"{name}: pdserve's ids differ from llama-tokenize's at token {first_diff} "
                f"({len(ids)} vs {len(theirs)} tokens): pdserve is scored on llama.cpp's")  # fmt: skip
            ids = theirs
    chunking = plan(len(ids), args.ctx, args.chunks, bos)
    row.update(tokens=len(ids), chunks=chunking.num_chunks, scored=chunking.num_scored, n_ctx=chunking.n_ctx)
    say(f"{name}: {len(ids)} tokens, {chunking.num_chunks} chunks of {chunking.n_ctx}, "
        f"{chunking.num_scored} scored, BOS {'id ' + str(bos) if bos is not None else 'not added'}")  # fmt: skip
    if with_llamacpp:
        assert tools is not None
        row["llamacpp"] = run_llamacpp(name, tools, path, args, chunking, args.llamacpp_arg)
        if args.llamacpp_f32:
            with tempfile.TemporaryDirectory(prefix="pdserve-ppl-f32-") as scratch:
                copy = os.path.join(scratch, "f32.gguf")
                say(f"{name}: dequantizing a float32 copy for llama.cpp (llama-quantize F32)")
                llamacpp_run.f32_copy(tools, path, copy, args.threads)
                row["llamacpp_f32"] = run_llamacpp(f"{name} (f32 copy)", tools, copy, args, chunking,
                                                   [*llamacpp_run.F32_ARGS, *args.llamacpp_arg])  # fmt: skip
    modes = [("compared", args.dtype, args.quantization)]
    if not args.no_default:
        modes.append(("default", "auto", "auto"))
    for key, dtype, quantization in modes:
        run = run_pdserve(path, dtype, quantization, ids, chunking, args.forward_tokens)
        row[key] = {**asdict(run), "load_seconds": round(run.load_seconds, 2),
                    "eval_seconds": round(run.eval_seconds, 2)}  # fmt: skip
        if "llamacpp" in row:
            row[key]["diff"] = run.ppl / row["llamacpp"]["ppl"] - 1.0
        if "llamacpp_f32" in row:
            row[key]["diff_f32"] = run.ppl / row["llamacpp_f32"]["ppl"] - 1.0
    if "llamacpp" in row:
        row["pass"] = abs(row["compared"]["diff"]) <= args.bound
    return row


def run_llamacpp(label: str, tools: llamacpp_run.Tools, path: str, args: argparse.Namespace, chunking: Chunking,
                 extra: list[str]) -> dict[str, Any]:  # fmt: skip
    """``llama-perplexity`` on ``path``, checked to have cut the chunks pdserve planned."""
    argv = llamacpp_run.perplexity_argv(tools, path, args.text, args.ctx, args.threads, args.chunks, extra)
    say(f"{label}: {' '.join(argv)}")
    theirs = llamacpp_run.run_perplexity(argv)
    say(f"{label}: llama.cpp PPL = {theirs.ppl:.4f} +/- {theirs.error:.5f} ({theirs.seconds:.1f}s)")
    if theirs.num_chunks != chunking.num_chunks or theirs.n_ctx != chunking.n_ctx:
        raise RuntimeError(
            f"llama-perplexity ran {theirs.num_chunks} chunks of {theirs.n_ctx}; "
            f"pdserve planned {chunking.num_chunks} of {chunking.n_ctx}"
        )
    return {
        "ppl": theirs.ppl,
        "error": theirs.error,
        "chunk_ppls": theirs.chunk_ppls,
        "seconds": round(theirs.seconds, 2),
        "argv": theirs.argv,
        "system_info": theirs.system_info,
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.forward_tokens is not None and args.forward_tokens < 1:
        parser.error(f"--forward-tokens must be positive, got {args.forward_tokens}")
    if args.threads < 1 or args.ctx < 4:
        print("error: --threads must be positive and --ctx at least 4", file=sys.stderr)
        return 2
    try:
        with open(args.text, encoding="utf-8") as f:
            raw = f.read()
    except OSError as exc:
        print(f"error: --text: {exc}", file=sys.stderr)
        return 2
    text = text_as_llamacpp_reads_it(raw)
    torch.set_num_threads(args.threads)
    from pdserve.bench.common.machine import git_commit, machine_info, machine_line

    machine = machine_info()
    say(machine_line(machine))
    rows: list[dict[str, Any]] = []
    try:
        tools = None
        if not args.no_llamacpp:
            tools = llamacpp_run.ensure_tools(side_venv.cache_dir(args.peer_cache), say)
            say(f"llama.cpp: {tools.version}")
        for name in args.model or DEFAULT_MODELS:
            rows.append(measure_model(name, args, text, tools))
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    title = (f"bench perplexity: ctx {args.ctx}, {os.path.basename(args.text)}, pdserve {args.dtype} "
             f"{args.quantization} vs llama.cpp (bound {args.bound:.1%}); {machine_line(machine)}")  # fmt: skip
    print_table(title, report.table_rows(rows), report.COLUMNS, width=report.WIDTH)
    payload = {
        "benchmark": "perplexity",
        "argv": sys.argv[1:] if argv is None else argv,
        "git_commit": git_commit(),
        "machine": machine,
        "llama_cpp": None if tools is None else tools.version,
        "text": {
            "path": os.path.abspath(args.text),
            "sha256": hashlib.sha256(raw.encode()).hexdigest(),
            "chars": len(raw),
        },  # fmt: skip
        "ctx": args.ctx,
        "max_chunks": args.chunks,
        "threads": args.threads,
        "bound": args.bound,
        "compared_mode": {"dtype": args.dtype, "quantization": args.quantization},
        "forward_tokens": args.forward_tokens,  # None: each chunk in one forward pass
        "models": rows,
    }
    save_json(args.json or default_path("perplexity", "json"), payload)
    report.plot(rows, args.bound, args.plot or default_path("perplexity", "png"))
    failed = [row["model"] for row in rows if row.get("pass") is False]
    if failed:
        say(f"outside the {args.bound:.1%} bound: {', '.join(failed)}")
        return 1
    return 0
