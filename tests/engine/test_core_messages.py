"""The front <-> core messages: every type round-trips, and anything else is a ValueError."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pdserve.engine import messages
from pdserve.engine.outputs import EngineCoreOutput, SchedulerStats
from pdserve.engine.request import SamplingParams

FRONT_MESSAGES = [
    messages.AddRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=4, temperature=0.5, seed=7, stop_token_ids=(9,)),
        kv_transfer_params={"do_remote_decode": True, "remote_block_ids": [4, 5]},
        priority=-1,
        arrival_time=12.5,
    ),
    messages.Abort(["r1", "r2"]),
    messages.StatsQuery(nonce=3),
    messages.ResetPrefixCache(nonce=4),
    messages.Shutdown(),
]
CORE_MESSAGES = [
    messages.Ready(
        messages.CoreInfo(
            vocab_size=100,
            eos_token_id=None,
            max_model_len=64,
            num_blocks=8,
            block_size=16,
            connector={"engine_id": "p", "transport": "tcp"},
            dtype="bfloat16",
            torch_threads=1,
            cpus="0-1",
        )
    ),
    messages.Outputs(
        [
            EngineCoreOutput("r1", [5, 6]),
            EngineCoreOutput("r2", [], finish_reason="stop", stop_reason=2, kv_transfer_params={"a": 1}),
        ]
    ),
    messages.StatsReply(
        nonce=3, stats=SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25, kv_connector={"x": 1})
    ),
    messages.ResetPrefixCacheReply(nonce=4, ok=True),
]


@pytest.mark.parametrize("message", FRONT_MESSAGES, ids=lambda m: m.TYPE)
def test_front_messages_round_trip(message):
    assert messages.decode_from_front(messages.encode(message)) == message


@pytest.mark.parametrize("message", CORE_MESSAGES, ids=lambda m: m.TYPE)
def test_core_messages_round_trip(message):
    assert messages.decode_from_core(messages.encode(message)) == message


def test_every_output_field_crosses():
    """The encoding follows the dataclass: a field added to EngineCoreOutput needs no edit here."""
    output = EngineCoreOutput("r", [1])
    wire = msgpack.unpackb(messages.encode(messages.Outputs([output])))
    assert set(wire["outputs"][0]) == {f.name for f in dataclasses.fields(EngineCoreOutput)}


def _tamper(message, **changes) -> bytes:
    plain = msgpack.unpackb(messages.encode(message))
    for path, value in changes.items():
        target = plain
        *parents, leaf = path.split("__")
        for key in parents:
            target = target[key]
        if value is _DELETE:
            del target[leaf]
        else:
            target[leaf] = value
    return msgpack.packb(plain)


_DELETE = object()
ADD = FRONT_MESSAGES[0]
STATS_REPLY = CORE_MESSAGES[2]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used in msgpack
        msgpack.packb([1, 2]),
        msgpack.packb({"no": "type"}),
        msgpack.packb({"type": 7}),
        msgpack.packb({"type": "launch_missiles"}),
        messages.encode(CORE_MESSAGES[1]),  # a core message sent to the core
        _tamper(ADD, extra=1),
        _tamper(ADD, priority=_DELETE),
        _tamper(ADD, prompt_token_ids="abc"),
        _tamper(ADD, prompt_token_ids=[1, "2"]),
        _tamper(ADD, priority=True),
        _tamper(ADD, arrival_time="now"),
        _tamper(ADD, sampling_params__temprature=1.0),
        _tamper(ADD, sampling_params__max_tokens=_DELETE),
        _tamper(ADD, sampling_params__max_tokens=0),  # SamplingParams' own validation
        _tamper(ADD, sampling_params=None),
        _tamper(messages.StatsQuery(nonce=1), nonce=None),
    ],
)
def test_malformed_front_messages_raise_value_error(data):
    with pytest.raises(ValueError):
        messages.decode_from_front(data)


@pytest.mark.parametrize(
    "data",
    [
        messages.encode(messages.Shutdown()),  # a front message sent to the front
        _tamper(STATS_REPLY, stats__num_running=2),  # a renamed field is refused, not read as 0
        _tamper(STATS_REPLY, stats__num_running_reqs=_DELETE),
        _tamper(STATS_REPLY, stats__kv_cache_usage="full"),
        _tamper(CORE_MESSAGES[1], outputs=[{"request_id": "r"}]),
        _tamper(CORE_MESSAGES[0], info__vocab_size=_DELETE),
    ],
)
def test_malformed_core_messages_raise_value_error(data):
    with pytest.raises(ValueError):
        messages.decode_from_core(data)
