"""pdserve's side: llama.cpp's chunks (``scheme``) through a loaded model's serving path.

Each chunk is one prefill of a fresh sequence at positions ``0..n_ctx-1`` in its own paged KV
cache (no cached prefix), through ``model.forward`` as the runner calls it for a lone prompt;
only the scored rows' hidden states are projected to the vocab (``compute_logits``, float32).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.bench.perplexity.scheme import Chunking, NllTally, chunk_inputs, scored_nlls
from pdserve.engine.model.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from pdserve.engine.model.loader import LoadedModel
    from pdserve.engine.model.tokenizer import Tokenizer

BLOCK_SIZE = 16
# Hidden rows projected to the vocab at once: [rows, 262144] fp32 logits (Gemma) stay near 270 MB.
_LOGIT_ROWS = 256


def adds_bos(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer puts BOS before a prompt (a GGUF file's ``add_bos_token`` rule,
    llama.cpp's ``llama_vocab_get_add_bos``): then llama.cpp starts every chunk with BOS."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    with_special, plain = tokenizer.encode("a", add_special_tokens=True), tokenizer.encode("a")
    return len(with_special) == len(plain) + 1 and with_special[0] == bos


def chunk_nlls(
    loaded: LoadedModel,
    ids: Sequence[int],
    first: int,
    kv_cache: torch.Tensor,
    forward_tokens: int | None = None,
) -> torch.Tensor:
    """``[len(ids) - first - 1]`` float64 NLLs of ``ids[first + 1:]``, each predicted from the
    tokens before it by one prefill of ``ids`` (``kv_cache``: room for ``len(ids)`` tokens), or
    by prefills of ``forward_tokens`` at a time, each attending to the cached ones before it:
    at 16 or fewer the matmuls run the decode kernels (``KERNEL_MAX_ROWS``), so that modes which
    differ only there (int8 activations, ``-a8``) are measured as a decode step computes."""
    model = loaded.model
    device = model.model.norm.weight.device
    n = len(ids)
    tokens = torch.tensor(list(ids), dtype=torch.long, device=device)
    positions = torch.arange(n, dtype=torch.long, device=device)
    step = n if forward_tokens is None else forward_tokens
    with torch.inference_mode():
        hidden = torch.cat(
            [
                model(tokens[s : s + step], positions[s : s + step], kv_cache,
                      prefill_metadata(min(step, n - s), BLOCK_SIZE, device, start=s))
                for s in range(0, n, step)
            ]
        )  # fmt: skip
        parts = []
        for row in range(first, n - 1, _LOGIT_ROWS):
            stop = min(row + _LOGIT_ROWS, n - 1)
            parts.append(scored_nlls(model.compute_logits(hidden[row:stop]), tokens[row + 1 : stop + 1]))
    return torch.cat(parts)


def evaluate(
    loaded: LoadedModel,
    tokens: Sequence[int],
    chunking: Chunking,
    say: Callable[[str], None] | None = None,
    forward_tokens: int | None = None,
) -> NllTally:
    """The tally of every chunk of ``tokens`` as llama.cpp cuts and scores them (``forward_tokens``:
    see ``chunk_nlls``)."""
    spec = loaded.arch.kv_cache_spec(BLOCK_SIZE, loaded.dtype)
    kv_cache = spec.allocate(-(-chunking.n_ctx // BLOCK_SIZE), device=loaded.model.model.norm.weight.device)
    tally = NllTally()
    for index in range(chunking.num_chunks):
        start = time.perf_counter()
        ids = chunk_inputs(tokens, chunking, index)
        tally.add_chunk(chunk_nlls(loaded, ids, chunking.first, kv_cache, forward_tokens))
        if say is not None:
            say(f"  chunk {index + 1}/{chunking.num_chunks}: running PPL {tally.running_ppl():.4f} "
                f"({time.perf_counter() - start:.1f}s)")  # fmt: skip
    return tally


def prefill_metadata(length: int, block_size: int, device: torch.device, start: int = 0) -> AttentionMetadata:
    """One sequence's prefill chunk of ``length`` tokens at positions ``start..start+length-1``,
    in blocks ``0, 1, ...``, positions before ``start`` already in the cache (what
    ``ModelRunner._attention_metadata`` builds for a lone prompt's chunk; ``start`` 0: its whole
    prompt, nothing cached)."""
    seq_len = start + length
    num_blocks = -(-seq_len // block_size)
    return AttentionMetadata(
        slot_mapping=torch.arange(start, seq_len, dtype=torch.long, device=device),
        num_decode_tokens=0,
        decode_block_tables=torch.zeros((0, 0), dtype=torch.int32, device=device),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
        prefill_block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),
        prefill_query_start_loc=torch.tensor([0, length], dtype=torch.int32, device=device),
        prefill_seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
    )
