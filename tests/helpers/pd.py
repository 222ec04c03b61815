"""Start a prefill and a decode engine core (two processes) wired by hand, no router."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from pdserve.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import SamplingParams


def engine_config(model_path: str | None, role: str, transport: str, **kv: object) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=model_path),
        scheduler=SchedulerConfig(max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=32),
        cache=CacheConfig(block_size=16, num_blocks=int(kv.pop("num_blocks", 256))),
        kv_transfer=KVTransferConfig(role=role, transport=transport, engine_id=role, **kv),
    )


@contextmanager
def pd_pair(
    model_path: str | None, transport: str, prefill_kv: dict | None = None, decode_kv: dict | None = None
):
    """Both cores, started at once: each client's constructor blocks until its core has loaded
    the model (several seconds for the tiny model, ~15 s for the bundled one on 2 cores), and
    neither core needs the other to start (decode learns prefill's address per request)."""
    configs = [
        engine_config(model_path, "producer", transport, **(prefill_kv or {})),
        engine_config(model_path, "consumer", transport, **(decode_kv or {})),
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        starting = [pool.submit(EngineCoreClient, config) for config in configs]
    started = [f.result() for f in starting if f.exception() is None]
    try:
        for future in starting:
            future.result()  # a core that failed to start fails the test, once the other is closed
        prefill, decode = started
        yield prefill, decode
    finally:
        for client in reversed(started):  # decode first, as before: it may still pull from prefill
            client.close()


def pd_generate(
    prefill: EngineCoreClient,
    decode: EngineCoreClient,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
) -> tuple[EngineCoreOutput, EngineCoreOutput]:
    """The disaggregated path by hand: prefill's first token, then decode pulls and continues."""
    first = prefill.generate(
        request_id,
        prompt,
        SamplingParams(max_tokens=1, ignore_eos=True),
        kv_transfer_params={"do_remote_decode": True},
    )
    assert first.finish_reason == "length", first
    assert first.kv_transfer_params and first.kv_transfer_params["do_remote_prefill"], first
    rest = decode.generate(
        request_id,
        prompt + first.new_token_ids,
        SamplingParams(max_tokens=max_tokens - 1, ignore_eos=True),
        kv_transfer_params=first.kv_transfer_params,
    )
    return first, rest


def wait_idle(client: EngineCoreClient, timeout_s: float = 15.0) -> dict:
    """Stats once the engine holds no KV blocks (or the last stats seen, at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        idle = stats["kv_cache_usage"] == 0.0 and stats["num_held_blocks"] == 0
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
