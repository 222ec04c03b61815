"""The router's engine choice: what each policy picks among the healthy engines of a role."""

from __future__ import annotations

from typing import Any

from pdserve.router.engines import EngineHandle
from pdserve.router.policies import RoutingPolicy


def _engine(role: str, address: str, in_flight: int = 0) -> EngineHandle:
    # Channels and stubs are never touched by a policy.
    unused: Any = None
    return EngineHandle(
        role, address, channel=unused, stub=unused, health=unused, healthy=True, in_flight=in_flight
    )


def test_round_robin_takes_turns_within_each_role_when_requests_pick_both():
    policy = RoutingPolicy("round_robin")
    prefills = [_engine("prefill", "p0")]
    decodes = [_engine("decode", "d0"), _engine("decode", "d1")]
    picked = []
    for _ in range(4):  # each disaggregated request: a prefill pick, then a decode pick
        policy.pick(prefills, [])
        picked.append(policy.pick(decodes, []).address)
    assert picked == ["d0", "d1", "d0", "d1"]


def test_least_loaded_and_prefix_policies():
    busy, idle = _engine("decode", "busy", in_flight=3), _engine("decode", "idle", in_flight=1)
    assert RoutingPolicy("least_loaded").pick([busy, idle], []).address == "idle"
    busy.remember_blocks([11, 22])
    prefix = RoutingPolicy("prefix")
    assert prefix.pick([busy, idle], [11, 22, 33]).address == "busy"  # holds the prompt's first blocks
    assert prefix.pick([busy, idle], [99]).address == "idle"  # nobody does: the less loaded one
