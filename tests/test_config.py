"""Config validation: every invalid value or combination is a ValueError naming the fields."""

from __future__ import annotations

import pytest

from pdserve.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig


def _raises_naming(fields: tuple[str, ...], build) -> str:
    with pytest.raises(ValueError) as excinfo:
        build()
    message = str(excinfo.value)
    for name in fields:
        assert name in message, f"{name!r} not named in: {message}"
    return message


def test_defaults_are_valid():
    config = SchedulerConfig()
    assert config.policy == "fcfs"
    assert config.max_num_batched_tokens >= config.max_num_seqs
    cache = CacheConfig()
    assert cache.block_size > 0 and cache.num_blocks > 0
    ModelConfig()
    KVTransferConfig()


def test_batched_tokens_below_model_len_without_chunked_prefill_is_rejected():
    _raises_naming(
        ("max_num_batched_tokens", "max_model_len", "enable_chunked_prefill"),
        lambda: SchedulerConfig(
            max_num_batched_tokens=512, max_num_seqs=8, max_model_len=1024, enable_chunked_prefill=False
        ),
    )


def test_batched_tokens_below_model_len_is_fine_with_chunked_prefill():
    config = SchedulerConfig(
        max_num_batched_tokens=512, max_num_seqs=8, max_model_len=1024, enable_chunked_prefill=True
    )
    assert config.max_num_batched_tokens == 512


def test_batched_tokens_equal_to_model_len_without_chunked_prefill_is_fine():
    SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, enable_chunked_prefill=False)


def test_batched_tokens_below_max_num_seqs_is_rejected():
    _raises_naming(
        ("max_num_batched_tokens", "max_num_seqs"),
        lambda: SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16, max_model_len=8),
    )


def test_unknown_policy_is_rejected():
    message = _raises_naming(("policy",), lambda: SchedulerConfig(policy="lifo"))
    assert "lifo" in message


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_known_policies_are_accepted(policy):
    assert SchedulerConfig(policy=policy).policy == policy


def test_long_prefill_threshold_above_model_len_is_rejected():
    _raises_naming(
        ("long_prefill_token_threshold", "max_model_len"),
        lambda: SchedulerConfig(
            max_model_len=128, max_num_batched_tokens=128, long_prefill_token_threshold=129
        ),
    )


def test_negative_long_prefill_threshold_is_rejected():
    _raises_naming(
        ("long_prefill_token_threshold",), lambda: SchedulerConfig(long_prefill_token_threshold=-1)
    )


def test_long_prefill_threshold_up_to_model_len_is_accepted():
    assert (
        SchedulerConfig(max_model_len=128, long_prefill_token_threshold=128).long_prefill_token_threshold
        == 128
    )


@pytest.mark.parametrize("field", ["max_num_batched_tokens", "max_num_seqs", "max_model_len"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_non_positive_or_non_integer_scheduler_sizes_are_rejected(field, value):
    _raises_naming((field,), lambda: SchedulerConfig(**{field: value}))


def test_unknown_kv_load_failure_policy_is_rejected():
    _raises_naming(("kv_load_failure_policy",), lambda: SchedulerConfig(kv_load_failure_policy="retry"))


@pytest.mark.parametrize("block_size", [0, -16, 3, 12, 2.0])
def test_bad_block_size_is_rejected(block_size):
    _raises_naming(("block_size",), lambda: CacheConfig(block_size=block_size))


@pytest.mark.parametrize("num_blocks", [0, -1, 1.5])
def test_bad_num_blocks_is_rejected(num_blocks):
    _raises_naming(("num_blocks",), lambda: CacheConfig(num_blocks=num_blocks))


@pytest.mark.parametrize("block_size", [1, 2, 16, 32])
def test_power_of_two_block_sizes_are_accepted(block_size):
    assert CacheConfig(block_size=block_size, num_blocks=1).block_size == block_size


def test_model_config_rejects_unknown_dtype():
    _raises_naming(("dtype",), lambda: ModelConfig(dtype="float16x"))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "sender"}, "role"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"lease_ms": 0}, "lease_ms"),
        ({"transfer_timeout_s": 0}, "transfer_timeout_s"),
        ({"side_channel_port": 70_000}, "side_channel_port"),
        ({"side_channel_port": -1}, "side_channel_port"),
    ],
)
def test_kv_transfer_config_rejects_bad_values(kwargs, field):
    _raises_naming((field,), lambda: KVTransferConfig(**kwargs))


def test_engine_config_carries_core_cpus_to_the_core_process():
    """The cpus the core pins itself to travel in the config the front hands the core (JSON)."""
    config = EngineConfig(core_cpus=[1, 3])
    assert EngineConfig.from_json(config.to_json()).core_cpus == [1, 3]
    assert EngineConfig.from_json(EngineConfig().to_json()).core_cpus is None


@pytest.mark.parametrize("core_cpus", [[], [-1]])
def test_engine_config_rejects_core_cpus_naming_no_cpu(core_cpus):
    with pytest.raises(ValueError, match="core_cpus"):
        EngineConfig(core_cpus=core_cpus)


def test_engine_command_rejects_core_cpus_it_may_not_use():
    import argparse
    import os

    from pdserve.engine.server import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    not_mine, mine = max(os.sched_getaffinity(0)) + 1, min(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=rf"--core-cpus names cpus \[{not_mine}\]"):
        engine_config_from_args(parser.parse_args(["--port", "1", "--core-cpus", str(not_mine)]), "producer")
    config = engine_config_from_args(parser.parse_args(["--port", "1", "--core-cpus", str(mine)]), "producer")
    assert config.core_cpus == [mine]
