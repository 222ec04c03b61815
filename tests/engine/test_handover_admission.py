"""A decode request that arrives while a step runs starts its KV pull mid-step, and nothing leaks.

The engine core takes new requests in between decoder layers (``EngineCore.run_busy_loop``)
and gives a remote-prefill request its blocks at once (``Scheduler.admit_remote_loads``), so
the pull overlaps the step in flight and the request runs in the next one; with
``handover_step="inflight"`` a request whose KV has landed joins the step in flight itself
(``Scheduler.join_landed``, ``ModelRunner.join_decodes``). These tests drive the real busy loop
over tiny models with a scripted input channel and a connector whose loads land only when the
test says, so "mid-step" and "the next step" are exact, not timed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.config import CacheConfig, SchedulerConfig
from pdserve.engine.core import AbortRequests, EngineCore, EngineCoreRequest
from pdserve.engine.model.loader import load_model
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import SamplingParams
from tests.helpers.scheduler import FakeConnector, assert_idle_and_no_leak


class WorkerFakeConnector(FakeConnector):
    """FakeConnector plus the worker side: loads land when the test calls ``land``."""

    def __init__(self) -> None:
        super().__init__(delay_free_aborted_loads=True)
        self.core: EngineCore | None = None
        self.land_at_start = False  # the pull ends within the step it started in
        self.load_started_mid_step: dict[str, bool] = {}  # {req_id: was a step in flight}
        self.fail_loads = False  # landed loads report all their blocks invalid
        self._landed: set[str] = set()
        self._invalid: set[int] = set()
        self._done: set[str] = set()  # loads reported finished

    def start_load_kv(self, metadata: Any) -> None:
        assert self.core is not None
        for req_id, block_ids in self.loads_started.items():
            if req_id not in self.load_started_mid_step:
                self.load_started_mid_step[req_id] = self.core._stepping
                self._write_remote_kv(block_ids)
                if self.land_at_start:
                    self.land(req_id)

    def _write_remote_kv(self, block_ids: list[int]) -> None:
        """What the prefill engine would have sent: arbitrary but fixed K/V, so attention over
        the pulled prompt matters to the tokens (and differs from whatever the blocks held)."""
        assert self.core is not None
        kv_cache = self.core.runner.kv_cache
        generator = torch.Generator().manual_seed(1234)
        shape = (len(block_ids), *kv_cache.shape[1:])
        kv_cache[block_ids] = torch.randn(shape, generator=generator).to(kv_cache.dtype)

    def land(self, req_id: str) -> None:
        self._landed.add(req_id)
        if self.fail_loads:
            self._invalid |= set(self.loads_started[req_id])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._landed = self._landed, set()
        self._done |= done
        return None, done or None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay_free, params = super().request_finished(request, block_ids)
        # Like the real connector: a load that has ended writes nothing more, so nothing is held.
        return delay_free and request.request_id not in self._done, params

    def get_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid


class Script:
    """The core's input channel: what arrives at the loop top and in between layers."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.at_top: list[list[Any]] = []  # one list per loop-top call, in order
        self.mid_step: list[list[Any]] = []  # one list per mid-step call, in order
        self.outputs: list[tuple[int, EngineCoreOutput]] = []  # (step index, output)
        self.steps = 0
        self.on_step_end: list[Any] = []  # callables(step index) run after each step

    def receive(self, timeout: float | None) -> list[Any]:
        if self.core._stepping:
            return self.mid_step.pop(0) if self.mid_step else []
        return self.at_top.pop(0) if self.at_top else []

    def emit(self, outputs: list[EngineCoreOutput]) -> None:
        # Step outputs are emitted after the step (counted already); inputs' outputs between.
        self.outputs += [(self.steps - 1, o) for o in outputs]

    def should_stop(self) -> bool:
        return not self.at_top and not self.mid_step and not self.core.has_work() and self.steps > 0


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture(scope="module")
def four_layer_loaded(tmp_path_factory):
    """Polled before layers 1, 2 and 3; an in-flight join is allowed up to layer 2."""
    from pdserve.engine.model.tiny import write_tiny_model

    return load_model(write_tiny_model(str(tmp_path_factory.mktemp("tiny-4-layers")), seed=3, num_layers=4))


@pytest.fixture(scope="module")
def four_layer_gemma_loaded(tmp_path_factory):
    """As ``four_layer_loaded``, a Gemma 3: every layer reads its RoPE table out of the pass's
    two (``Gemma3ForCausalLM.embed``), which a joining row must bring along; its four layers
    are sliding ones (window 32), past which both requests run."""
    from pdserve.engine.model.tiny import write_tiny_model

    directory = str(tmp_path_factory.mktemp("tiny-gemma3-4-layers"))
    return load_model(write_tiny_model(directory, seed=3, num_layers=4, variant="gemma3"))


def make_core(
    tiny_loaded, handover_step: str = "joined", num_blocks: int = 64
) -> tuple[EngineCore, WorkerFakeConnector, Script]:
    connector = WorkerFakeConnector()
    core = EngineCore(
        tiny_loaded,
        SchedulerConfig(
            max_model_len=512, max_num_batched_tokens=512, max_num_seqs=8, handover_step=handover_step
        ),
        CacheConfig(block_size=16, num_blocks=num_blocks),
        connector,
    )
    connector.core = core
    script = Script(core)
    step = core.step

    def counted_step() -> list[EngineCoreOutput]:
        outputs = step()
        for hook in script.on_step_end:
            hook(script.steps)
        script.steps += 1
        return outputs

    core.step = counted_step  # type: ignore[method-assign]
    return core, connector, script


def local_request(request_id: str, num_tokens: int, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def remote_request(request_id: str, num_tokens: int, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id,
        list(range(7, 7 + num_tokens)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        kv_transfer_params={"do_remote_prefill": True, "num_tokens": num_tokens},
    )


def step_of_first_token(script: Script, request_id: str) -> int:
    return min(step for step, o in script.outputs if o.request_id == request_id and o.new_token_ids)


def test_decode_request_arriving_mid_step_pulls_at_once_and_runs_next_step(tiny_loaded):
    core, connector, script = make_core(tiny_loaded)
    script.at_top = [[local_request("busy", 100, 6)]]
    script.mid_step = [[remote_request("remote", 48, 4)]]  # arrives during step 0
    connector.land_at_start = True  # the pull lands before step 0 ends (it overlaps the step)

    core.run_busy_loop(script.receive, script.emit, script.should_stop)

    assert connector.load_started_mid_step == {"remote": True}
    assert step_of_first_token(script, "remote") == 1  # the step right after the one it arrived in
    assert sum(len(o.new_token_ids) for _, o in script.outputs if o.request_id == "remote") == 4
    assert sum(len(o.new_token_ids) for _, o in script.outputs if o.request_id == "busy") == 6
    events = {k for _, o in script.outputs if o.request_id == "remote" for k in (o.timeline or {})}
    assert {"received", "admitted", "load_done", "scheduled", "first_token", "finished"} <= events
    assert_idle_and_no_leak(core.scheduler)


def test_abort_during_mid_step_admission_frees_everything_once_the_pull_ends(tiny_loaded):
    core, connector, script = make_core(tiny_loaded)
    script.at_top = [[local_request("busy", 100, 8)]]
    script.mid_step = [[remote_request("remote", 48, 4)], [AbortRequests(["remote"])]]
    held_while_pulling: list[int] = []

    def after_step(step: int) -> None:
        if step == 0:
            # Aborted at the end of step 0, pull still writing: its blocks must stay allocated.
            held_while_pulling.append(core.scheduler.kv_cache_manager.num_blocks_of("remote"))
        if step == 2:
            connector.land("remote")  # the pull ends late; only now may its blocks be freed

    script.on_step_end.append(after_step)
    core.run_busy_loop(script.receive, script.emit, script.should_stop)

    assert connector.load_started_mid_step == {"remote": True}
    remote_outputs = [o for _, o in script.outputs if o.request_id == "remote"]
    assert [o.finish_reason for o in remote_outputs] == ["abort"]
    assert all(not o.new_token_ids for o in remote_outputs)
    assert held_while_pulling == [3]  # 48 tokens in 16-token blocks, allocated mid-step
    assert ("remote", "FINISHED_ABORTED") in {(r, s.name) for r, _, s in connector.finished_calls}
    assert_idle_and_no_leak(core.scheduler)


def test_abort_before_the_pull_starts_is_handled_after_the_step(tiny_loaded):
    """An abort arriving mid-step for a request that is not admitted early (no remote KV) is
    deferred to the step's end and still frees everything."""
    core, connector, script = make_core(tiny_loaded)
    script.at_top = [[local_request("busy", 100, 4)]]
    script.mid_step = [[local_request("late", 20, 4)], [AbortRequests(["late"])]]
    core.run_busy_loop(script.receive, script.emit, script.should_stop)
    late = [o for _, o in script.outputs if o.request_id == "late"]
    assert late and late[-1].finish_reason == "abort"
    assert connector.load_started_mid_step == {}
    assert_idle_and_no_leak(core.scheduler)


# ---------------------------------------------------------------------- joining the step in flight

POLLS_PER_STEP = 3  # the four-layer model is polled before layers 1, 2 and 3


def tokens_of(script: Script, request_id: str) -> list[int]:
    return [t for _, o in script.outputs if o.request_id == request_id for t in o.new_token_ids]


def run_remote_arriving_at(loaded, handover_step: str, poll: int, busy_tokens: int = 100):
    """A busy local request, and a remote one arriving at mid-step poll ``poll`` (counted from
    the first step) whose pull lands at once."""
    core, connector, script = make_core(loaded, handover_step)
    script.at_top = [[local_request("busy", busy_tokens, 6)]]
    script.mid_step = [[] for _ in range(poll)] + [[remote_request("remote", 40, 5)]]
    connector.land_at_start = True
    core.run_busy_loop(script.receive, script.emit, script.should_stop)
    assert_idle_and_no_leak(core.scheduler)
    return core, script


@pytest.mark.parametrize("model", ["four_layer_loaded", "four_layer_gemma_loaded"])
@pytest.mark.parametrize(
    "poll, batch",
    [(0, "a prefill chunk"), (2 * POLLS_PER_STEP, "decodes"), (2 * POLLS_PER_STEP + 1, "decodes")],
)
def test_landed_request_joins_the_step_in_flight_with_the_tokens_of_the_next_step(
    request, model, poll, batch
):
    """Joined at layer 1 or 2 of the step it landed in, the request's first decode token comes
    with that step, not the next, and every token (its own and the busy request's) is the one
    the ordinary next-step handover gives: the missed layers ran, with the right K/V."""
    loaded = request.getfixturevalue(model)
    joined_core, joined = run_remote_arriving_at(loaded, "joined", poll)
    core, inflight = run_remote_arriving_at(loaded, "inflight", poll)

    arrival_step = poll // POLLS_PER_STEP
    assert step_of_first_token(joined, "remote") == arrival_step + 1
    assert step_of_first_token(inflight, "remote") == arrival_step
    assert core.num_joined_in_flight == 1 and joined_core.num_joined_in_flight == 0
    assert len(tokens_of(inflight, "remote")) == 5 and len(tokens_of(inflight, "busy")) == 6
    assert tokens_of(inflight, "remote") == tokens_of(joined, "remote")
    assert tokens_of(inflight, "busy") == tokens_of(joined, "busy")
    events = {k for _, o in inflight.outputs if o.request_id == "remote" for k in (o.timeline or {})}
    assert {"admitted", "load_done", "scheduled", "joined_in_flight", "first_token", "finished"} <= events


def test_a_step_past_half_its_layers_is_not_joined(four_layer_loaded):
    """Landing before layer 3 of 4, the request waits for the next step: catching up three
    layers alone would cost the running requests more than it saves."""
    core, script = run_remote_arriving_at(four_layer_loaded, "inflight", 2 * POLLS_PER_STEP + 2)
    assert core.num_joined_in_flight == 0
    assert step_of_first_token(script, "remote") == 3


def test_abort_of_a_request_that_joined_mid_step_frees_everything(four_layer_loaded):
    core, connector, script = make_core(four_layer_loaded, "inflight")
    script.at_top = [[local_request("busy", 30, 6)]]
    # Arrives (and lands) before layer 1 of step 1, aborted before layer 2 of the same step.
    script.mid_step = [[], [], [], [remote_request("remote", 40, 5)], [AbortRequests(["remote"])]]
    connector.land_at_start = True
    core.run_busy_loop(script.receive, script.emit, script.should_stop)

    assert core.num_joined_in_flight == 1
    remote_outputs = [(step, o) for step, o in script.outputs if o.request_id == "remote"]
    # Its token from the step it joined, then the abort handled right after that step.
    assert [(step, len(o.new_token_ids), o.finish_reason) for step, o in remote_outputs] == [
        (1, 1, None),
        (1, 0, "abort"),
    ]
    assert len(tokens_of(script, "busy")) == 6
    assert_idle_and_no_leak(core.scheduler)


def test_a_failed_load_polled_mid_step_is_recomputed_after_the_step_not_joined(four_layer_loaded):
    """Invalid blocks may roll back running requests, which only the step's end may do: the
    failure polled mid-step is carried there, and the request recomputes its prompt."""
    core, connector, script = make_core(four_layer_loaded, "inflight")
    script.at_top = [[local_request("busy", 30, 6)]]
    script.mid_step = [[], [], [], [remote_request("remote", 40, 5)]]
    connector.land_at_start = True
    connector.fail_loads = True
    core.run_busy_loop(script.receive, script.emit, script.should_stop)

    assert core.num_joined_in_flight == 0
    assert step_of_first_token(script, "remote") == 2  # recomputed in the next step
    assert len(tokens_of(script, "remote")) == 5 and len(tokens_of(script, "busy")) == 6
    assert_idle_and_no_leak(core.scheduler)


def test_a_step_that_fails_after_a_failed_load_was_polled_handles_that_load_at_once(four_layer_loaded):
    """The carried failed load is applied with the failed step, not a step later (by then the
    connector has forgotten the load, and an abort could free blocks it would invalidate)."""
    core, connector, script = make_core(four_layer_loaded, "inflight")
    script.at_top = [[local_request("busy", 30, 6)]]
    script.mid_step = [[], [], [], [remote_request("remote", 40, 5)]]  # step 1, before layer 1
    connector.land_at_start = True
    connector.fail_loads = True
    last_layer = core.runner.model.model.layers[3]
    forward = last_layer.forward
    carried_after_step: list[bool] = []

    def fails_in_step_1(*args: Any) -> Any:
        if script.steps == 1:
            raise RuntimeError("injected")
        return forward(*args)

    last_layer.forward = fails_in_step_1  # type: ignore[method-assign]
    script.on_step_end.append(lambda step: carried_after_step.append(core._carried_transfers is not None))
    core.run_busy_loop(script.receive, script.emit, script.should_stop)

    assert carried_after_step[1] is False
    assert [o.finish_reason for _, o in script.outputs if o.request_id == "busy"][-1] == "error"
    assert len(tokens_of(script, "remote")) == 5  # recomputed after the failed step
    assert_idle_and_no_leak(core.scheduler)


def test_no_join_takes_the_block_a_running_request_needs_next(four_layer_loaded):
    """11 blocks: busy holds 7, the remote prompt 3; joining would take the last free one (for
    the first decode token at position 40), leaving none for busy's next token."""
    core, connector, script = make_core(four_layer_loaded, "inflight", num_blocks=11)
    script.at_top = [[local_request("busy", 100, 6)]]
    script.mid_step = [[], [], [], [remote_request("remote", 40, 5)]]
    connector.land_at_start = True
    core.run_busy_loop(script.receive, script.emit, script.should_stop)

    assert core.num_joined_in_flight == 0
    assert core.scheduler.num_preemptions == 0
    assert len(tokens_of(script, "remote")) == 5 and len(tokens_of(script, "busy")) == 6
    assert_idle_and_no_leak(core.scheduler)


class RecordingLender:
    """Stands in for ``LentThreads``: what the busy loop told the cpu board, in order."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.calls: list[str] = []

    def begin_step(self) -> int:
        self.calls.append("busy")
        return 1

    def idle(self) -> None:
        self.calls.append("idle")

    def apply(self) -> int:
        self.calls.append("apply")
        return 1


def test_an_engine_is_busy_only_while_a_step_computes_and_lends_its_cores_otherwise(tiny_loaded):
    """Core lending's contract with the busy loop: busy for every step that computes tokens (and
    the step re-checks the board between layers); idle while only a KV pull is in flight, and as
    soon as its last request finishes, before the loop waits for input."""
    core, connector, script = make_core(tiny_loaded)
    lender = RecordingLender(core)
    core.lent_threads = lender  # type: ignore[assignment]
    waits: list[tuple[float | None, str]] = []  # (receive's timeout, the last thing said then)
    receive = script.receive

    def recorded_receive(timeout: float | None) -> list[Any]:
        if not core._stepping:
            waits.append((timeout, lender.calls[-1] if lender.calls else ""))
        return receive(timeout)

    script.at_top = [[remote_request("remote", 32, 3)]]  # a decode request: pull first, then steps
    landed_after = 3  # zero-token steps while the pull is in flight

    def land(step: int) -> None:
        if step == landed_after:
            connector.land("remote")

    script.on_step_end.append(land)
    core.run_busy_loop(recorded_receive, script.emit, script.should_stop)

    assert sum(len(o.new_token_ids) for _, o in script.outputs if o.request_id == "remote") == 3
    # Every step marks the board before it runs: idle while it has no tokens (the pull), busy for
    # each of the decode steps that compute the tokens.
    marks = [c for c in lender.calls if c != "apply"]
    assert marks[: landed_after + 1] == ["idle"] * (landed_after + 1)
    assert marks.count("busy") == 3
    assert "apply" in lender.calls  # between layers, the board is read again
    # Idle before any wait for input once the request is done: its cores are lent meanwhile.
    assert marks[-1] == "idle"
    # ("": nothing said yet, the state the engine process starts its loop in: idle.)
    assert all(said in ("idle", "") or timeout == 0.0 for timeout, said in waits), waits
    assert_idle_and_no_leak(core.scheduler)
