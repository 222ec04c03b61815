"""One model step over a fresh paged KV cache, as the runner would lay it out: the attention
metadata of a batch of decodes and prefill chunks, and the logits they give."""

from __future__ import annotations

import torch

from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.layers.attention import AttentionMetadata
from pdserve.engine.model.llama import LlamaForCausalLM

BLOCK_SIZE = 16


def attn_batch(
    decodes: list[tuple[list[int], int]] = (),
    prefills: list[tuple[list[int], int, int]] = (),
    block_size: int = BLOCK_SIZE,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for one step, decodes first as the runner orders them.

    ``decodes``: ``(block_table, seq_len)``, one new token at position ``seq_len - 1``;
    ``prefills``: ``(block_table, num_computed, num_new)``, a chunk after ``num_computed`` tokens.
    """
    width = max([len(bt) for bt, *_ in [*decodes, *prefills]] or [1])

    def table(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32).reshape(
            len(rows), width
        )

    def slot(block_table: list[int], pos: int) -> int:
        return block_table[pos // block_size] * block_size + pos % block_size

    positions = [seq_len - 1 for _, seq_len in decodes]
    for _, done, new in prefills:
        positions += range(done, done + new)
    slots = [slot(bt, seq_len - 1) for bt, seq_len in decodes]
    for bt, done, new in prefills:
        slots += [slot(bt, p) for p in range(done, done + new)]
    starts = [0]
    for _, _, new in prefills:
        starts.append(starts[-1] + new)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decode_tokens=len(decodes),
        decode_block_tables=table([bt for bt, _ in decodes]),
        decode_seq_lens=torch.tensor([n for _, n in decodes], dtype=torch.int32),
        prefill_block_tables=table([bt for bt, _, _ in prefills]),
        prefill_query_start_loc=torch.tensor(starts if prefills else [], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([done + new for _, done, new in prefills], dtype=torch.int32),
    )
    return meta, torch.tensor(positions, dtype=torch.int64)


def run_step(
    model: LlamaForCausalLM, kv_cache: torch.Tensor, input_ids: list[int], meta, positions
) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(torch.tensor(input_ids, dtype=torch.int64), positions, kv_cache, meta)
        return model.compute_logits(hidden)


def prefill_logits(model: LlamaForCausalLM, arch: ModelArchConfig, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids``, one prefill into a fresh cache."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    kv = arch.kv_cache_spec(BLOCK_SIZE, model.model.norm.weight.dtype).allocate(num_blocks)
    meta, positions = attn_batch(prefills=[(list(range(num_blocks)), 0, len(ids))])
    return run_step(model, kv, ids, meta, positions)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-3) -> None:
    """Max abs difference within ``rel`` of the logits' scale, and the same greedy tokens."""
    diff = (actual.float() - expected.float()).abs().max().item()
    scale = expected.abs().max().item()
    assert diff <= rel * scale, f"max |diff| {diff:.3g} > {rel} * {scale:.3g}"
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
