"""A pipe that a thread sleeping on its sockets watches too, so another thread can wake it.

The KV threads (the ucx transport's worker, the side channel's server, the KV-event replay
thread) sleep in ``select`` or a ``zmq.Poller`` with no timeout: on a 2-core KVM guest a
periodic wake-up costs ~90 us of CPU, which an idle engine should not spend. Whoever has work
for such a thread, or wants it to stop, calls ``wake``.
"""

from __future__ import annotations

import contextlib
import os


class WakePipe:
    """``fileno()`` goes to ``select`` / ``zmq.Poller`` with the thread's sockets; ``wake()``
    from any thread never blocks (a full pipe holds wake-ups already); the sleeper ``drain()``s
    it when it keeps sleeping on it, and ``close()`` comes once the sleeper has ended."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._closed = False

    def fileno(self) -> int:
        return self._read

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._write, b"!")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._read)
            os.close(self._write)
