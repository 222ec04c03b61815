"""KV caches in shared memory that another process on this host can map (the ``shm`` transport).

A cache allocated with ``allocate_shared`` lives in an anonymous ``memfd``: no file in
``/dev/shm`` to leak when an engine is killed (the memory goes with the last process that maps
it), and no name another user could guess. A peer opens it through ``/proc/<pid>/fd/<fd>``,
which the kernel allows only to a process of the same user in the same pid namespace on the
same host, and maps it read-only. ``SharedRegion`` is what the owner advertises for that.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import select
import uuid
import warnings
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


@dataclass(frozen=True)
class SharedRegion:
    """Where a peer finds a shared cache: the owner's pid and fd, the memfd's name (which
    carries a random nonce, so a recycled pid or fd is never mistaken for it), its size, and
    the host's boot id (a peer on another host must not look up a pid here)."""

    pid: int
    fd: int
    name: str
    nbytes: int
    boot_id: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SharedRegion:
        try:
            region = cls(
                pid=data["pid"],
                fd=data["fd"],
                name=data["name"],
                nbytes=data["nbytes"],
                boot_id=data["boot_id"],
            )
        except KeyError as exc:
            raise ValueError(f"shared region: missing {exc.args[0]!r}") from None
        for key, kind in (("pid", int), ("fd", int), ("name", str), ("nbytes", int), ("boot_id", str)):
            if type(getattr(region, key)) is not kind:
                raise ValueError(
                    f"shared region: {key} must be {kind.__name__}, got {getattr(region, key)!r}"
                )
        return region


# {data_ptr of a shared cache: its region}; entries go when the tensor is freed.
_regions: dict[int, SharedRegion] = {}


def shared_memory_unavailable() -> str | None:
    """None if this process can share memory this way, else why not."""
    if not hasattr(os, "memfd_create") or not hasattr(os, "pidfd_open"):
        return "os.memfd_create / os.pidfd_open are not available (Linux only)"
    if not os.path.exists(_BOOT_ID_PATH) or not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return "/proc is not mounted"
    return None


def boot_id() -> str:
    """This host's boot id: equal for every process on the host (and container on it)."""
    with open(_BOOT_ID_PATH) as f:
        return f.read().strip()


def allocate_shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor in a fresh memfd that ``region_of`` can describe to a peer."""
    reason = shared_memory_unavailable()
    if reason is not None:
        raise RuntimeError(f"cannot allocate a shared KV cache: {reason}")
    nbytes = math.prod(shape) * dtype.itemsize
    name = f"pdserve-kv-{uuid.uuid4().hex}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)  # zero-filled, pages allocated on first touch
        buffer = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
    _regions[tensor.data_ptr()] = SharedRegion(os.getpid(), fd, name, nbytes, boot_id())
    # The fd stays open while the tensor lives: it is how peers find the memory.
    weakref.finalize(tensor, _release, tensor.data_ptr(), fd)
    return tensor


def _release(data_ptr: int, fd: int) -> None:
    _regions.pop(data_ptr, None)
    os.close(fd)


def region_of(tensor: torch.Tensor) -> SharedRegion | None:
    """The shared region ``tensor`` starts (None if it was not made by ``allocate_shared``)."""
    region = _regions.get(tensor.data_ptr())
    if region is None or region.pid != os.getpid():  # a forked child does not own the fd's pid
        return None
    return region


class PeerMapping:
    """A peer's shared region mapped read-only here, with a cheap check that the peer lives.

    The mapping itself outlives the peer (we hold a reference to the memory), so a read could
    copy a dead engine's last bytes; ``peer_alive`` tells a read to fail instead. (A peer that
    is alive but freed the blocks is caught by the lease release after the read.)
    """

    def __init__(self, region: SharedRegion, bytes_per_block: int) -> None:
        reason = shared_memory_unavailable()
        if reason is not None:
            raise ValueError(f"shm: {reason}")
        if region.boot_id != boot_id():
            raise ValueError("shm: the peer runs on another host (boot ids differ); use nixl, ucx or tcp")
        # A pidfd names the process itself (a recycled pid cannot pass for it) and becomes
        # readable when it exits: the per-read liveness check is one poll(), no /proc lookup.
        # Opened before the memfd check in _map_read_only, so both are known to be one process.
        try:
            self._pidfd = os.pidfd_open(region.pid)
        except OSError as exc:
            raise ValueError(
                f"shm: the peer's process {region.pid} is not visible here ({exc.strerror}): "
                "shm needs both engines on one host, in one pid namespace"
            ) from None
        try:
            self._buffer = _map_read_only(region)
        except BaseException:
            os.close(self._pidfd)
            raise
        self._exited = select.poll()
        self._exited.register(self._pidfd, select.POLLIN)
        with warnings.catch_warnings():  # read-only on purpose: we never write a peer's cache
            warnings.simplefilter("ignore", UserWarning)
            # Where the mapping starts, for raw copies; valid until close(). (The temporary
            # view is dropped at once: a view left over would keep close() from unmapping.)
            self.address = torch.frombuffer(self._buffer, dtype=torch.uint8).data_ptr()
        self.num_blocks = region.nbytes // bytes_per_block  # the peer's blocks, whatever it claims

    def peer_alive(self) -> bool:
        """True while the peer process runs (its pidfd is not readable yet)."""
        return not self._exited.poll(0)

    def close(self) -> None:
        """Unmap. The caller makes sure no read copies from ``address`` any more (the shm
        transport holds its peers lock for every copy and closes a mapping only once it has
        taken it out of its table under that lock)."""
        with contextlib.suppress(OSError):
            os.close(self._pidfd)
        self._buffer.close()


def _map_read_only(region: SharedRegion) -> mmap.mmap:
    """The owner's memfd, found through its /proc fd entry and mapped read-only."""
    path = f"/proc/{region.pid}/fd/{region.fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{region.name}"):
            raise ValueError(f"shm: {path} is not the peer's KV cache (the peer is gone)")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(
            f"shm: cannot open the peer's KV cache at {path} ({exc.strerror}): "
            "shm needs both engines on one host, as one user, in one pid namespace"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size != region.nbytes:
            raise ValueError(f"shm: the peer's cache has {size} bytes, it advertised {region.nbytes}")
        return mmap.mmap(fd, region.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
