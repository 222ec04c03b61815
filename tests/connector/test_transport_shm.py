"""The shm transport's own rules: shared caches only, one host only, a gone peer fails reads.

Exact bytes, scattered blocks, a killed prefill and the P/D pair are covered for every
transport, shm included, in ``test_transport_two_process.py`` and ``test_pd_two_process.py``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from pdserve.connector.transports import create_transport, unavailable_reason
from pdserve.engine.kv_layout import KVCacheSpec
from pdserve.engine.shared_memory import region_of

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
NUM_BLOCKS = 8

pytestmark = pytest.mark.skipif(
    unavailable_reason("shm") is not None, reason=f"shm: {unavailable_reason('shm')}"
)


def _serving_cache() -> torch.Tensor:
    cache = SPEC.allocate(NUM_BLOCKS, shared=True)
    cache.copy_(torch.rand(cache.shape, generator=torch.Generator().manual_seed(3)))
    return cache


def test_a_shared_cache_is_zeroed_and_freed_with_its_tensor():
    cache = SPEC.allocate(NUM_BLOCKS, shared=True)
    assert cache.shape == (NUM_BLOCKS, *SPEC.block_shape) and cache.dtype == torch.float32
    assert not cache.any()
    region = region_of(cache)
    assert region is not None and region.nbytes == cache.numel() * 4
    path = f"/proc/self/fd/{region.fd}"
    assert os.readlink(path).startswith(f"/memfd:{region.name}")
    del cache
    gc.collect()
    assert not os.path.exists(path) or not os.readlink(path).startswith(f"/memfd:{region.name}")
    assert region_of(SPEC.allocate(NUM_BLOCKS)) is None  # a plain cache has no region


def test_serving_needs_a_shared_cache_but_reading_does_not():
    with pytest.raises(ValueError, match="shared memory"):
        create_transport("shm", SPEC.allocate(NUM_BLOCKS), role="producer", spec=SPEC)
    create_transport("shm", SPEC.allocate(NUM_BLOCKS), role="consumer", spec=SPEC).close()


def test_read_copies_the_blocks_and_refuses_ones_the_peer_does_not_have():
    server = create_transport("shm", _serving_cache(), role="producer", engine_id="prefill", spec=SPEC)
    reader = create_transport("shm", SPEC.allocate(NUM_BLOCKS), role="consumer", spec=SPEC)
    try:
        reader.add_remote("prefill", server.local_metadata())
        reader.start_read("r", "prefill", [5, 6, 1], [0, 1, 7])
        [result] = reader.wait(5.0)
        assert result.ok and result.nbytes == 3 * SPEC.bytes_per_block
        assert torch.equal(reader.kv_cache[[0, 1, 7]], server.kv_cache[[5, 6, 1]])
        # A peer that claims more blocks than its memory holds: the read fails, nothing copied.
        reader.add_remote("liar", {**server.local_metadata(), "num_blocks": 4 * NUM_BLOCKS})
        reader.start_read("far", "liar", [NUM_BLOCKS + 1], [2])
        [far] = reader.wait(5.0)
        assert not far.ok and "outside blocks" in far.error
        assert not reader.kv_cache[2].any()
    finally:
        reader.close()
        server.close()


def test_a_peer_on_another_host_or_without_a_region_is_refused():
    server = create_transport("shm", _serving_cache(), role="producer", engine_id="prefill", spec=SPEC)
    reader = create_transport("shm", SPEC.allocate(NUM_BLOCKS), role="consumer", spec=SPEC)
    try:
        meta = server.local_metadata()
        elsewhere = {**meta, "region": {**meta["region"], "boot_id": "another-host"}}
        with pytest.raises(ValueError, match="another host"):
            reader.add_remote("prefill", elsewhere)
        with pytest.raises(ValueError, match="does not serve shm reads"):
            reader.add_remote("prefill", {k: v for k, v in meta.items() if k != "region"})
        with pytest.raises(ValueError, match="pid must be int"):
            reader.add_remote("prefill", {**meta, "region": {**meta["region"], "pid": "1"}})
        assert not reader.has_remote("prefill")
    finally:
        reader.close()
        server.close()


_CHILD = """
import sys, msgpack
from pdserve.connector.transports import create_transport
from pdserve.engine.kv_layout import KVCacheSpec
spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
cache = spec.allocate(8, shared=True)
cache.fill_(7.0)
server = create_transport("shm", cache, role="producer", engine_id="prefill", spec=spec)
sys.stdout.buffer.write(msgpack.packb(server.local_metadata()))
sys.stdout.buffer.flush()
sys.stdin.read()  # serve until the test closes our stdin
"""


def test_reads_fail_once_the_serving_process_is_gone_and_a_new_mapping_is_refused():
    import msgpack

    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        unpacker = msgpack.Unpacker()
        while True:
            chunk = child.stdout.read1(65536)
            assert chunk, "child exited before advertising its cache"
            unpacker.feed(chunk)
            metadata = next(iter(unpacker), None)
            if metadata is not None:
                break
        reader = create_transport("shm", SPEC.allocate(NUM_BLOCKS), role="consumer", spec=SPEC)
        reader.add_remote("prefill", metadata)
        reader.start_read("alive", "prefill", [2], [3])
        [alive] = reader.wait(5.0)
        assert alive.ok and bool((reader.kv_cache[3] == 7.0).all())

        child.stdin.close()
        child.wait(30)
        reader.start_read("gone", "prefill", [4], [4])
        [gone] = reader.wait(5.0)
        assert not gone.ok and "is gone" in gone.error
        assert not reader.kv_cache[4].any()
        reader.close()

        again = create_transport("shm", SPEC.allocate(NUM_BLOCKS), role="consumer", spec=SPEC)
        with pytest.raises(ValueError, match="not visible here|cannot open|is not the peer"):
            again.add_remote("prefill", metadata)
        again.close()
    finally:
        child.kill()
        child.wait()
