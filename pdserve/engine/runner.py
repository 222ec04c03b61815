"""ModelRunner: turns a SchedulerOutput into one batched forward pass and sampled tokens.

It only executes: what to run was decided by the scheduler. It keeps a mirror of each
request's tokens and block table (updated from the scheduler's deltas), flattens the step's
tokens with decodes first, builds the paged-attention metadata, runs the model, and samples
one token for every request whose known tokens are now all computed.

It drives the decoder layers itself rather than calling the model's ``forward``: between two
layers it lets the engine core look at its input (``call_between_layers``), and a decode request
whose KV has just landed can join the pass in flight there (``join_decodes``): its row runs the
layers it missed alone, then continues with the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.connector.base import KVConnectorBase
from pdserve.engine.kv_layout import KVCacheSpec
from pdserve.engine.model.layers.attention import AttentionMetadata
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model.weights import pack_linear_weights
from pdserve.engine.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pdserve.engine.sampler import SamplingState, sample
from pdserve.kernels.cpu.decoder_layer import FusedPass

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    """The runner's copy of one request: tokens so far, block table, computed prefix."""

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingState = field(repr=False)


@dataclass
class _Segment:
    """One request's slice of the flattened batch."""

    state: CachedRequestState
    start: int  # first position computed this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class _Pass:
    """A forward pass in flight: its segments (decodes first) and the next layer's input."""

    segments: list[_Segment]
    num_decodes: int
    hidden: torch.Tensor  # [num_tokens, hidden]
    cos: torch.Tensor  # [num_tokens, rope tables, head_dim] (LlamaForCausalLM.embed)
    sin_signed: torch.Tensor
    meta: AttentionMetadata
    fused: FusedPass | None  # the pass's layers as runs of fused C calls, when they can be


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache_spec: KVCacheSpec,
        num_blocks: int,
        connector: KVConnectorBase | None = None,
        device: str = "cpu",
    ) -> None:
        self.model = model
        # Served, not trained or saved: the projections may run on weights packed for oneDNN.
        pack_linear_weights(model)
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.device = torch.device(device)
        shared = connector is not None and connector.needs_shared_kv_cache
        self.kv_cache = kv_cache_spec.allocate(num_blocks, device=self.device, shared=shared)
        self.connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_cache)
        self.vocab_size = model.config.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self._between_layers: Callable[[int], None] | None = None
        self._poll_layers: frozenset[int] = frozenset()
        self._pass: _Pass | None = None  # the forward pass in flight
        self._joining: list[str] = []  # requests that join it at the next layer

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    def call_between_layers(self, callback: Callable[[int], None], every: int) -> Callable[[], None]:
        """Call ``callback(layer_index)`` before every ``every``-th decoder layer of each pass.

        The engine core uses it to take in new requests while a long step runs, so that a
        decode request's KV pull starts mid-step (see ``Scheduler.admit_remote_loads``), and to
        let requests whose KV has landed join the pass (``join_decodes``). The callback runs on
        the engine thread, between two layers: it must not touch the tensors of the step in
        flight. Returns a function that removes the callback again.
        """
        num_layers = self.num_layers
        # Every ``every``-th layer after the first; a shallow model still gets one call mid-pass.
        chosen = list(range(every, num_layers, every)) or [num_layers // 2]
        self._between_layers = callback
        self._poll_layers = frozenset(chosen)

        def remove() -> None:
            self._between_layers = None
            self._poll_layers = frozenset()

        return remove

    def join_decodes(self, new_requests: list[NewRequestData]) -> None:
        """Add one-token decodes to the forward pass in flight, from the between-layers callback.

        Each joining row first runs, alone, the layers the pass has already done (writing its
        K/V for them), then continues with the batch from the next layer and is sampled with
        it. The scheduler has already added the requests to the step's ``SchedulerOutput``.
        """
        if self._pass is None:
            raise RuntimeError("join_decodes() called outside a forward pass")
        for new in new_requests:
            if new.num_computed_tokens + 1 != len(new.prompt_token_ids) + len(new.output_token_ids):
                raise ValueError(f"{new.req_id}: only a request with one token left to compute can join")
            self._add_request_state(new)
            self._joining.append(new.req_id)

    # ------------------------------------------------------------------ state mirror

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._add_request_state(new)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(cached.new_block_ids[i])
            else:
                state.block_ids.extend(cached.new_block_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def _add_request_state(self, new: NewRequestData) -> None:
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling=SamplingState.create(
                new.sampling_params,
                new.eos_token_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                self.vocab_size,
            ),
        )

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        connector = self.connector
        if connector is not None and scheduler_output.kv_connector_metadata is not None:
            connector.start_load_kv(scheduler_output.kv_connector_metadata)

        req_ids: list[str] = []
        sampled: list[list[int]] = []
        if scheduler_output.total_num_scheduled_tokens > 0:
            req_ids, sampled = self._forward_and_sample(scheduler_output.num_scheduled_tokens)

        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        if connector is not None:
            connector.wait_for_save()
            output.finished_sending, output.finished_recving = connector.get_finished(
                scheduler_output.finished_req_ids
            )
            output.invalid_block_ids = connector.get_invalid_block_ids() or None
        return output

    def _forward_and_sample(self, num_scheduled_tokens: dict[str, int]) -> tuple[list[str], list[list[int]]]:
        req_ids = list(num_scheduled_tokens)  # before any request joins the pass
        segments = [
            _Segment(self.requests[req_id], self.requests[req_id].num_computed_tokens, n)
            for req_id, n in num_scheduled_tokens.items()
        ]
        # Decodes (single-token segments) first: the attention op batches them in one call.
        segments.sort(key=lambda seg: seg.num_tokens != 1)
        num_decodes = sum(1 for seg in segments if seg.num_tokens == 1)
        self._pass = self._start_pass(segments, num_decodes)
        try:
            hidden = self._run_layers(self._pass)
            segments = self._pass.segments
            scheduled = set(req_ids)
            req_ids += [seg.state.req_id for seg in segments if seg.state.req_id not in scheduled]
        finally:
            self._pass, self._joining = None, []

        # Sample only where every known token is now computed (not mid-prefill).
        sample_rows: list[int] = []
        sampling_segments: list[_Segment] = []
        offset = 0
        for seg in segments:
            offset += seg.num_tokens
            seg.state.num_computed_tokens = seg.end
            if seg.end >= len(seg.state.token_ids):
                sample_rows.append(offset - 1)
                sampling_segments.append(seg)
        new_tokens: dict[str, list[int]] = {}
        if sample_rows:
            logits = self.model.compute_logits(hidden[sample_rows])
            tokens = sample(logits, [seg.state.sampling for seg in sampling_segments])
            for seg, token in zip(sampling_segments, tokens, strict=True):
                seg.state.token_ids.append(token)
                new_tokens[seg.state.req_id] = [token]
        return req_ids, [new_tokens.get(req_id, []) for req_id in req_ids]

    def _start_pass(self, segments: list[_Segment], num_decodes: int) -> _Pass:
        input_ids, positions, slot_mapping = self._flatten(segments)
        meta = self._attention_metadata(segments, num_decodes, slot_mapping)
        hidden, cos, sin_signed = self.model.embed(input_ids, positions)
        fused = self.model.fused_pass(hidden, cos, sin_signed, self.kv_cache, meta)
        return _Pass(segments, num_decodes, hidden, cos, sin_signed, meta, fused)

    def _run_layers(self, fwd: _Pass) -> torch.Tensor:
        """Every decoder layer over the pass, polling in between; the final-normed hidden."""
        polls = sorted(self._poll_layers) if self._between_layers is not None else []
        first = 0
        for end in [*polls, self.num_layers]:
            self._run_range(fwd, first, end)
            first = end
            if end < self.num_layers:
                assert self._between_layers is not None
                self._between_layers(end)
                if self._joining:
                    self._merge_joining(fwd, end)
        return self.model.model.norm(fwd.hidden)

    def _run_range(self, fwd: _Pass, first: int, end: int) -> None:
        """Layers ``first .. end - 1``: one C call when the pass is fused, else layer by layer."""
        if first >= end:
            return
        if fwd.fused is not None:
            fwd.hidden = fwd.fused.run(first, end, fwd.hidden)
            return
        for index in range(first, end):
            layer = self.model.model.layers[index]
            fwd.hidden = layer(fwd.hidden, fwd.cos, fwd.sin_signed, self.kv_cache[:, index], fwd.meta)

    def _merge_joining(self, fwd: _Pass, next_layer: int) -> None:
        """Catch the joining rows up to ``next_layer`` alone, then splice them into the pass
        right after its decodes (they are decodes too) with metadata for the larger batch."""
        joins = [
            _Segment(self.requests[req_id], self.requests[req_id].num_computed_tokens, 1)
            for req_id in self._joining
        ]
        self._joining = []
        caught_up = self._start_pass(joins, len(joins))
        self._run_range(caught_up, 0, next_layer)
        split = fwd.num_decodes

        def spliced(batch: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            return torch.cat((batch[:split], rows, batch[split:]))

        fwd.hidden = spliced(fwd.hidden, caught_up.hidden)
        fwd.cos = spliced(fwd.cos, caught_up.cos)
        fwd.sin_signed = spliced(fwd.sin_signed, caught_up.sin_signed)
        fwd.segments = fwd.segments[:split] + joins + fwd.segments[split:]
        fwd.num_decodes += len(joins)
        fwd.meta = self._attention_metadata(
            fwd.segments, fwd.num_decodes, spliced(fwd.meta.slot_mapping, caught_up.meta.slot_mapping)
        )
        fwd.fused = self.model.fused_pass(fwd.hidden, fwd.cos, fwd.sin_signed, self.kv_cache, fwd.meta)

    def _flatten(self, segments: list[_Segment]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        bs = self.block_size
        for seg in segments:
            state = seg.state
            token_ids.extend(state.token_ids[seg.start : seg.end])
            positions.extend(range(seg.start, seg.end))
            blocks = state.block_ids
            slots.extend(blocks[pos // bs] * bs + pos % bs for pos in range(seg.start, seg.end))
        return (
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            torch.tensor(slots, dtype=torch.long, device=self.device),
        )

    def _attention_metadata(
        self, segments: list[_Segment], num_decodes: int, slot_mapping: torch.Tensor
    ) -> AttentionMetadata:
        def block_table(segs: list[_Segment]) -> torch.Tensor:
            width = max((-(-seg.end // self.block_size) for seg in segs), default=0)
            rows = [
                seg.state.block_ids[:width] + [0] * (width - min(width, len(seg.state.block_ids)))
                for seg in segs
            ]
            return torch.tensor(rows, dtype=torch.int32, device=self.device).reshape(len(segs), width)

        decodes, prefills = segments[:num_decodes], segments[num_decodes:]
        query_start = [0]
        for seg in prefills:
            query_start.append(query_start[-1] + seg.num_tokens)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=num_decodes,
            decode_block_tables=block_table(decodes),
            decode_seq_lens=torch.tensor([seg.end for seg in decodes], dtype=torch.int32, device=self.device),
            prefill_block_tables=block_table(prefills),
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=self.device),
            prefill_seq_lens=torch.tensor(
                [seg.end for seg in prefills], dtype=torch.int32, device=self.device
            ),
        )
