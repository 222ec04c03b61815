"""The Triton kernels against float64 torch references, run in Triton's CPU interpreter.

Why subprocesses: Triton decides at ``@triton.jit`` time whether a kernel is interpreted
(``TRITON_INTERPRET=1``) or compiled, so the mode must be set before ``pdserve.kernels.triton.ops``
is imported and would then stick for the whole pytest session, on a GPU machine too. Instead,
one module-scoped fixture runs this file as a script in worker processes, two interpreting the
kernels (in parallel: the interpreter is single-threaded) and one compiling them for a real GPU
target without the interpreter; each test then asserts on its case's result.

Accuracy is the *relative error* ``max|out - ref| / max|ref|``, with ``ref`` the torch reference
run in float64 on the same (already rounded) inputs: <= 1e-5 for fp32, <= 1e-2 for bf16.
Outputs are poisoned with NaN before each run and caches hold NaN wherever no context token
lives (unused blocks, the tail of a sequence's last block), so an unwritten output element, or a
masked-out position read without its mask, turns into NaN and fails. With a sliding window, a
decode's positions before its window hold NaN too: the kernel must not read them at all. Inputs are fresh random
numbers on every run; the seed is printed on failure (``PDSERVE_KERNEL_TEST_SEED`` replays it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import IO

import pytest
import torch

from tests.helpers.paths import REPO_ROOT

TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
SHARED_MEMORY_LIMIT = 99 * 1024  # the smallest per-block limit of sm_80+ GPUs (sm_86, sm_89)

# Attention cases: (kind, dtype, head_dim, group, num_kv_heads, block_size). "decode-split"
# forces the context split (flash-decoding) with 32-position partitions: 3 for these tables.
# It covers each dtype x GQA ratio once (head dims alternating) to save interpreter time.
ATTENTION = [
    (kind, dtype, head_dim, group, 3 if group == 3 else 2, 16)
    for kind in ("decode", "prefill")
    for dtype in ("float32", "bfloat16")
    for head_dim in (64, 128)
    for group in (1, 3, 8)
] + [
    ("decode-split", "float32", 64, 1, 2, 16),
    ("decode-split", "float32", 128, 3, 3, 16),
    ("decode-split", "float32", 64, 8, 2, 16),
    ("decode-split", "bfloat16", 128, 1, 2, 16),
    ("decode-split", "bfloat16", 64, 3, 3, 16),
    ("decode-split", "bfloat16", 128, 8, 2, 16),
    ("decode", "float32", 40, 3, 1, 5),  # odd head_dim and block size
    ("decode-split", "bfloat16", 40, 3, 1, 5),
    ("prefill", "float32", 40, 2, 2, 5),
    ("prefill", "bfloat16", 96, 4, 1, 8),
]
DECODE_SEQ_LENS = [1, 16, 17, 70, 33]  # 1 token, a full block, one past it, > a context tile
# Sliding-window cases: an attention case and its window. Against DECODE_SEQ_LENS (block size
# 16): 5 starts mid-block, 38 on a block boundary for 70 (and covers 33), 1 sees one position,
# 100 covers every context; a split decode's early partitions then read nothing. Against
# PREFILL_CHUNKS: 7 and 20 cut the cached prefixes and the 40-token chunk across its tiles.
ATTENTION_WINDOW = [
    (("decode", "float32", 64, 3, 3, 16), 5),
    (("decode", "bfloat16", 128, 8, 2, 16), 38),
    (("decode", "float32", 40, 3, 1, 5), 1),
    (("decode", "bfloat16", 64, 1, 2, 16), 100),
    (("decode-split", "float32", 64, 1, 2, 16), 5),
    (("decode-split", "bfloat16", 128, 3, 3, 16), 38),
    (("prefill", "float32", 64, 1, 2, 16), 7),
    (("prefill", "bfloat16", 64, 3, 3, 16), 20),
    (("prefill", "float32", 40, 2, 2, 5), 1),
    (("dispatch-decode", "float32", 64, 3, 3, 16), 5),  # through pdserve.kernels' dispatcher
    (("dispatch-prefill", "bfloat16", 64, 3, 3, 16), 20),
]
# Prefill chunks: (query tokens, context length including them)
# (40, 45) spans several query tiles, except at GQA ratio 1 (64-token tiles).
PREFILL_CHUNKS = [(1, 1), (5, 21), (17, 17), (0, 9), (40, 45), (1, 70)]
# reshape_and_cache cases: (key dtype, cache dtype, head_dim, num_kv_heads, block_size)
CACHE = [
    ("float32", "float32", 64, 2, 16),
    ("bfloat16", "bfloat16", 64, 3, 16),
    ("float32", "float32", 128, 1, 16),
    ("bfloat16", "bfloat16", 128, 8, 16),
    ("float32", "float32", 40, 3, 5),
    ("float32", "bfloat16", 64, 2, 16),  # the cast happens in the kernel
]
# gather/scatter cases: (dtype, num_layers, block_size, num_kv_heads, head_dim)
BLOCKS = [
    ("float32", 3, 16, 2, 64),  # 12288 elements per block: three full chunks
    ("bfloat16", 3, 16, 3, 64),  # 18432: a partial last chunk
    ("float32", 2, 5, 3, 40),  # 2400: less than one chunk
]


def _attention_id(case: tuple) -> str:
    kind, dtype, head_dim, group, num_kv_heads, block_size = case
    return f"{kind}-{dtype}-d{head_dim}-gqa{group}-kv{num_kv_heads}-bs{block_size}"


def _window_id(case: tuple) -> str:
    attention, window = case
    return f"{_attention_id(attention)}-window{window}"


def _cache_id(case: tuple) -> str:
    key_dtype, cache_dtype, head_dim, num_kv_heads, block_size = case
    return f"cache-{key_dtype}-into-{cache_dtype}-d{head_dim}-kv{num_kv_heads}-bs{block_size}"


def _blocks_id(case: tuple) -> str:
    dtype, num_layers, block_size, num_kv_heads, head_dim = case
    return f"blocks-{dtype}-l{num_layers}-bs{block_size}-kv{num_kv_heads}-d{head_dim}"


# Ahead-of-time compile cases: (kernel, dtype, head_dim, group); the widest tiles are included.
COMPILE = [
    ("decode", "bfloat16", 128, 8),
    ("decode-split", "float32", 64, 3),
    ("decode-split-window", "bfloat16", 128, 8),
    ("prefill-window", "float32", 128, 3),
    ("combine_partitions", "bfloat16", 128, 0),
    ("prefill", "float32", 128, 1),
    ("prefill", "float32", 256, 8),
    ("reshape_and_cache", "bfloat16", 64, 3),
    ("gather_blocks", "bfloat16", 0, 0),
]


def _compile_id(case: tuple) -> str:
    return "compile-{}-{}-d{}-gqa{}".format(*case)


# ----------------------------------------------------------------------------------------------
# Worker side: runs in a subprocess (``python tests/kernels/triton/test_ops.py MODE CASE_ID...``).
# ----------------------------------------------------------------------------------------------


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|out - ref| / max|ref|`` in float64; any NaN/inf in ``out`` makes it infinite."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _paged_context(
    gen: torch.Generator,
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 3-layer cache whose layer 1 holds each sequence's context in scattered blocks.

    Returns ``(layer_view, clean_layer64, block_tables)``: the (non-contiguous) layer view the
    kernel reads, NaN everywhere except at context positions, and the same layer in float64
    with zeros in place of NaN for the reference (whose batched masking would spread NaN).
    Unused block-table entries point at block 0, which no sequence uses and is all NaN: a
    kernel that masks a block-table load to 0 but reads through it unmasked sees NaN too.
    """
    blocks_per_seq = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    cache = torch.full((num_blocks, 3, 2, block_size, num_kv_heads, head_dim), math.nan, dtype=dtype)
    layer = cache[:, 1]
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros((len(seq_lens), max(blocks_per_seq) + 1), dtype=torch.int32)
    used = 0
    for seq, seq_len in enumerate(seq_lens):
        ids = perm[used : used + blocks_per_seq[seq]]
        used += blocks_per_seq[seq]
        tables[seq, : len(ids)] = ids.int()
        for pos in range(seq_len):
            kv = torch.randn(2, num_kv_heads, head_dim, generator=gen)
            layer[int(ids[pos // block_size]), :, pos % block_size] = kv.to(dtype)
    return layer, torch.nan_to_num(layer.double(), nan=0.0), tables


def _run_attention(case: tuple, gen: torch.Generator, window: int = 0, dispatcher=None) -> float:
    from pdserve.kernels import reference
    from pdserve.kernels.triton import attention as triton_attention
    from pdserve.kernels.triton import ops as triton_ops

    kind, dtype_name, head_dim, group, num_kv_heads, block_size = case
    windowed = {"sliding_window": window} if window else {}
    dtype = getattr(torch, dtype_name)
    num_heads = group * num_kv_heads
    scale = head_dim**-0.5
    if kind.startswith("decode"):
        seq_lens = DECODE_SEQ_LENS
        num_tokens = len(seq_lens)
    else:
        seq_lens = [n for _, n in PREFILL_CHUNKS]
        num_tokens = sum(q for q, _ in PREFILL_CHUNKS)
    layer, layer64, tables = _paged_context(gen, seq_lens, num_kv_heads, head_dim, block_size, dtype)
    if window and kind.startswith("decode"):  # what a decode must not read: before its window
        for seq, seq_len in enumerate(seq_lens):
            for pos in range(max(0, seq_len - window)):
                layer[int(tables[seq, pos // block_size]), :, pos % block_size] = math.nan
    # The query is a strided view into a fused QKV buffer, as the model produces it.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    query = qkv[:, :num_heads]
    out = torch.full((num_tokens, num_heads, head_dim), math.nan, dtype=dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    if dispatcher is not None and kind == "decode":
        out = dispatcher.paged_attention_decode(query, layer, tables, seq_lens_t, scale, **windowed)
    elif kind == "decode":
        triton_ops.paged_attention_decode(query, layer, tables, seq_lens_t, scale, out=out, **windowed)
    elif kind == "decode-split":
        max_positions = tables.shape[1] * block_size
        assert triton_attention.decode_partitions(len(seq_lens), num_kv_heads, max_positions, 32) == 3
        triton_attention.launch_paged_attention(
            query, layer, tables, None, seq_lens_t, scale, out, 32, sliding_window=window
        )
    if kind.startswith("decode"):
        ref = reference.paged_attention_decode_ref(
            query.double(), layer64, tables, seq_lens_t, scale, **windowed
        )
    else:
        starts = [0]
        for q_len, _ in PREFILL_CHUNKS:
            starts.append(starts[-1] + q_len)
        qsl = torch.tensor(starts, dtype=torch.int32)
        if dispatcher is not None:
            out = dispatcher.paged_attention_prefill(query, layer, tables, qsl, seq_lens_t, scale, **windowed)
        else:
            triton_ops.paged_attention_prefill(
                query, layer, tables, qsl, seq_lens_t, scale, out=out, **windowed
            )
        ref = reference.paged_attention_prefill_ref(
            query.double(), layer64, tables, qsl, seq_lens_t, scale, **windowed
        )
    return _relative_error(out, ref)


def _run_window(case: tuple, gen: torch.Generator) -> float:
    """A windowed case; a "dispatch-" one through ``pdserve.kernels`` with
    ``PDSERVE_KERNELS=triton`` (infinite unless the dispatcher reached the Triton op)."""
    attention, window = case
    if not attention[0].startswith("dispatch-"):
        return _run_attention(attention, gen, window)
    from pdserve import kernels
    from pdserve.kernels.triton import ops as triton_ops

    kind = attention[0].removeprefix("dispatch-")
    real, calls = getattr(triton_ops, f"paged_attention_{kind}"), []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("sliding_window"))
        return real(*args, **kwargs)

    os.environ["PDSERVE_KERNELS"] = "triton"
    setattr(triton_ops, f"paged_attention_{kind}", counted)
    try:
        # The dispatcher's signature (no ``out``): the kernel's own buffer, so no NaN poisoning.
        error = _run_attention((kind, *attention[1:]), gen, window, dispatcher=kernels)
    finally:
        setattr(triton_ops, f"paged_attention_{kind}", real)
        del os.environ["PDSERVE_KERNELS"]
    return error if calls == [window] else math.inf


def _run_cache(case: tuple, gen: torch.Generator) -> float:
    """Written slots must match the reference; every other element must keep its old bits."""
    from pdserve.kernels import reference
    from pdserve.kernels.triton import ops as triton_ops

    key_dtype_name, cache_dtype_name, head_dim, num_kv_heads, block_size = case
    key_dtype, cache_dtype = getattr(torch, key_dtype_name), getattr(torch, cache_dtype_name)
    num_blocks, num_tokens = 6, 23
    cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    expected = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:4]] = -1  # padding tokens
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(key_dtype)
    key, value = fused[:, 1], fused[:, 2]  # strided views, as split from a QKV projection
    triton_ops.reshape_and_cache(key, value, cache[:, 1], slots)
    reference.reshape_and_cache_ref(key, value, expected[:, 1], slots)

    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    valid = slots[slots >= 0]
    written[valid // block_size, valid % block_size] = True
    written = written[:, None, None, :, None, None].expand_as(cache).clone()
    written[:, 0] = False  # layer 0 is never written
    untouched_equal = torch.equal(cache[~written], expected[~written])
    if not untouched_equal:
        return math.inf
    if key_dtype == cache_dtype:  # a copy: exact
        return 0.0 if torch.equal(cache[written], expected[written]) else math.inf
    return _relative_error(cache[written], expected[written])


def _run_blocks(case: tuple, gen: torch.Generator) -> float:
    """Gather into a NaN-poisoned buffer (and a fresh one), scatter into a cache: all exact."""
    from pdserve.kernels import reference
    from pdserve.kernels.triton import ops as triton_ops

    dtype_name, num_layers, block_size, num_kv_heads, head_dim = case
    dtype = getattr(torch, dtype_name)
    shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
    cache = torch.randn(9, *shape, generator=gen).to(dtype)
    ids = torch.tensor([7, 0, 3, 3, 8])  # out of order, one repeated
    packed = torch.full((len(ids), *shape), math.nan, dtype=dtype)
    triton_ops.gather_blocks(cache, ids, packed)
    expected = reference.gather_blocks_ref(cache, ids)
    if not (torch.equal(packed, expected) and torch.equal(triton_ops.gather_blocks(cache, ids), expected)):
        return math.inf
    target = torch.randn(11, *shape, generator=gen).to(dtype)
    target_ref = target.clone()
    dst_ids = torch.tensor([10, 2, 5, 1, 6])
    triton_ops.scatter_blocks(target, dst_ids, packed)
    reference.scatter_blocks_ref(target_ref, dst_ids, packed)
    return 0.0 if torch.equal(target, target_ref) else math.inf


def _compile_sm80(case: tuple) -> int:
    """Compile one kernel for sm_80 (no GPU needed); returns its shared memory in bytes.

    The interpreter does not enforce what the Triton compiler rejects (or what a GPU cannot fit),
    so this is the check that the code users with a GPU run actually builds.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pdserve.kernels.triton.attention import (
        _combine_partitions_kernel,
        _paged_attention_kernel,
        attention_constexprs,
    )
    from pdserve.kernels.triton.blocks import _copy_blocks_kernel
    from pdserve.kernels.triton.cache import _reshape_and_cache_kernel

    kind, dtype_name, head_dim, group = case
    ptr = {"float32": "*fp32", "bfloat16": "*bf16"}[dtype_name]
    windowed = kind.endswith("-window")
    kind = kind.removesuffix("-window")
    if kind in ("decode", "decode-split", "prefill"):
        kernel = _paged_attention_kernel
        constexprs = attention_constexprs(group, head_dim, kind != "prefill", getattr(torch, dtype_name))
        if kind == "decode-split":
            constexprs["PARTITION"] = 256
        if windowed:
            constexprs["SLIDING"] = True
        pointers = {"out_ptr": ptr, "q_ptr": ptr, "kv_ptr": ptr, "scale_log2e": "fp32"}
        pointers |= dict.fromkeys(["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"], "*i32")
        pointers |= dict.fromkeys(["part_acc_ptr", "part_stats_ptr"], "*fp32")
    elif kind == "combine_partitions":
        kernel = _combine_partitions_kernel
        constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": head_dim, "BLOCK_P": 8}
        pointers = {"out_ptr": ptr, "part_acc_ptr": "*fp32", "part_stats_ptr": "*fp32"}
    elif kind == "reshape_and_cache":
        kernel = _reshape_and_cache_kernel
        constexprs = {"NUM_KV_HEADS": group, "HEAD_DIM": head_dim, "BLOCK_H": 4, "BLOCK_D": head_dim}
        pointers = {"key_ptr": ptr, "value_ptr": ptr, "cache_ptr": ptr, "slot_mapping_ptr": "*i64"}
    else:
        kernel = _copy_blocks_kernel
        constexprs = {"GATHER": True, "CHUNK": 4096}
        pointers = {"src_ptr": ptr, "dst_ptr": ptr, "block_ids_ptr": "*i64"}
    signature = {name: "i32" for name in kernel.arg_names} | pointers
    signature |= dict.fromkeys(constexprs, "constexpr")
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 80, 32), options={"num_warps": 4}
    )
    return int(compiled.metadata.shared)


def _worker(mode: str, case_ids: list[str]) -> None:
    """Run the named cases, printing one JSON line each: {id, value, seconds} or {id, error}."""
    seed = int(os.environ["PDSERVE_KERNEL_TEST_SEED"])
    if mode == "compile":
        assert "TRITON_INTERPRET" not in os.environ
        cases = {_compile_id(c): (_compile_sm80, c) for c in COMPILE}
    else:
        assert os.environ.get("TRITON_INTERPRET") == "1"
        cases = {_attention_id(c): (_run_attention, c) for c in ATTENTION}
        cases |= {_window_id(c): (_run_window, c) for c in ATTENTION_WINDOW}
        cases |= {_cache_id(c): (_run_cache, c) for c in CACHE}
        cases |= {_blocks_id(c): (_run_blocks, c) for c in BLOCKS}
    for case_id in case_ids:
        fn, case = cases[case_id]
        start = time.perf_counter()
        try:
            if mode == "compile":
                value = fn(case)
            else:
                gen = torch.Generator().manual_seed(seed + sum(map(ord, case_id)))
                torch.manual_seed(seed)
                value = fn(case, gen)
            line = {"id": case_id, "value": value, "seconds": time.perf_counter() - start}
        except Exception:
            line = {"id": case_id, "error": traceback.format_exc()}
        print(json.dumps(line), flush=True)


# ----------------------------------------------------------------------------------------------
# pytest side
# ----------------------------------------------------------------------------------------------

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

SEED = int(os.environ.get("PDSERVE_KERNEL_TEST_SEED", "0")) or int.from_bytes(os.urandom(3), "little")


def _spawn(mode: str, case_ids: list[str], stderr: IO[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PDSERVE_KERNELS")}
    env["PDSERVE_KERNEL_TEST_SEED"] = str(SEED)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences a 3.9 warning; the 3.9 default
    if mode != "compile":
        env["TRITON_INTERPRET"] = "1"
    return subprocess.Popen(
        [sys.executable, __file__, mode, *case_ids],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, dict]:
    """Run every case once, in three workers at the same time; {case id: result line}."""
    ids = {kind: [_attention_id(c) for c in ATTENTION if c[0] == kind] for kind in ("decode", "decode-split")}
    prefill = [_attention_id(c) for c in ATTENTION if c[0] == "prefill"]
    other = [_cache_id(c) for c in CACHE] + [_blocks_id(c) for c in BLOCKS]
    windows = [_window_id(c) for c in ATTENTION_WINDOW]
    # Roughly equal interpreter time each (a prefill case takes ~3 decode cases).
    work = [
        ("interpret", prefill[::2] + ids["decode"] + other + windows[::2]),
        ("interpret", prefill[1::2] + ids["decode-split"] + windows[1::2]),
        ("compile", [_compile_id(c) for c in COMPILE]),
    ]
    results: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        # stderr goes to files, not pipes, so no worker stalls while another one is being read.
        errs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in work]
        workers = [_spawn(mode, case_ids, err) for (mode, case_ids), err in zip(work, errs, strict=True)]
        for proc, err in zip(workers, errs, strict=True):
            stdout, _ = proc.communicate(timeout=600)
            for line in stdout.splitlines():
                if line.startswith("{"):
                    entry = json.loads(line)
                    results[entry["id"]] = entry
            if proc.returncode:
                err.seek(0)
                results.setdefault("_crashes", {"error": ""})["error"] += err.read()[-4000:]
    return results


def _result(results: dict[str, dict], case_id: str) -> float:
    entry = results.get(case_id)
    if entry is None:
        crash = results.get("_crashes", {}).get("error", "")
        pytest.fail(f"{case_id}: the worker never reported it (seed {SEED}).\n{crash}")
    if "error" in entry:
        pytest.fail(f"{case_id} raised (seed {SEED}):\n{entry['error']}")
    return entry["value"]


@pytest.mark.parametrize("case", ATTENTION, ids=_attention_id)
def test_kernel_paged_attention_matches_float64_reference(kernel_results: dict, case: tuple) -> None:
    error = _result(kernel_results, _attention_id(case))
    tolerance = TOLERANCE[case[1]]
    assert error <= tolerance, f"relative error {error:.3g} > {tolerance:g} (seed {SEED}; inf: NaN in output)"


@pytest.mark.parametrize("case", ATTENTION_WINDOW, ids=_window_id)
def test_kernel_paged_attention_with_a_window_matches_float64_reference(
    kernel_results: dict, case: tuple
) -> None:
    error = _result(kernel_results, _window_id(case))
    tolerance = TOLERANCE[case[0][1]]
    assert error <= tolerance, f"relative error {error:.3g} > {tolerance:g} (seed {SEED}; inf: NaN in output)"


@pytest.mark.parametrize("case", CACHE, ids=_cache_id)
def test_kernel_reshape_and_cache_writes_mapped_slots_only(kernel_results: dict, case: tuple) -> None:
    error = _result(kernel_results, _cache_id(case))
    tolerance = 0.0 if case[0] == case[1] else TOLERANCE[case[1]]
    assert error <= tolerance, (
        f"relative error {error:.3g} (inf: a slot was missed or clobbered; seed {SEED})"
    )


@pytest.mark.parametrize("case", BLOCKS, ids=_blocks_id)
def test_kernel_gather_scatter_blocks_copy_exactly(kernel_results: dict, case: tuple) -> None:
    assert _result(kernel_results, _blocks_id(case)) == 0.0, f"gather/scatter differs (seed {SEED})"


@pytest.mark.parametrize("case", COMPILE, ids=_compile_id)
def test_kernel_compiles_for_sm80_within_shared_memory(kernel_results: dict, case: tuple) -> None:
    shared = _result(kernel_results, _compile_id(case))
    assert shared <= SHARED_MEMORY_LIMIT, f"needs {shared} B of shared memory, > {SHARED_MEMORY_LIMIT}"


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
