"""The router's view of its engines: a gRPC stub each, health, and in-flight load.

A task per engine follows its health on the standard gRPC health service's ``Watch`` stream:
the engine sends its status when the stream opens and at every change, nothing in between (a
``Check`` a second cost the engine's front and the router each ~1.5 ms of CPU per call on a
2-core VM, taken from the engine cores). An engine that reports NOT_SERVING because it is
draining leaves the rotation at once and rejoins when it reports SERVING again. Engines are
also marked down the moment a call to them fails with UNAVAILABLE; the stream breaking (the
engine gone) marks it down too, and either way it is watched anew a second later, as often as
it takes to find it SERVING.

Engines that publish KV-cache events (their Info names an event port) are followed by the
pool's ``KVEventTracker``: from the moment an engine is healthy; and an engine that goes down,
leaves the pool or comes back as a new instance loses its index entries at once. Those engines
are also asked for their Info once a second (a restart, an event stream to start over).

Engines named by ``dns:NAME:PORT`` (``discovery.py``) are looked up again every
``discovery_interval`` seconds: a new address joins the pool (in rotation once its health check
says SERVING); a vanished one gets no new request and is dropped once its requests have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.router.discovery import EngineSource, Resolver, grpc_address
from pdserve.router.engine_session import EngineSession
from pdserve.router.kv_subscriber import KVEventTracker
from pdserve.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 1.0
DEFAULT_DISCOVERY_INTERVAL_S = 5.0
# How many prompt-block hashes the router remembers per engine for prefix-aware routing.
MAX_REMEMBERED_BLOCKS = 50_000


@dataclass(eq=False)
class EngineHandle:
    role: str  # "prefill" or "decode"
    address: str
    channel: grpc.aio.Channel = field(repr=False)
    stub: engine_pb2_grpc.EngineStub = field(repr=False)
    health: health_pb2_grpc.HealthStub = field(repr=False)
    # The one Session stream its requests share (opened at the first one).
    session: EngineSession = field(init=False, repr=False)
    healthy: bool = False
    info: engine_pb2.EngineInfo | None = None
    in_flight: int = 0  # requests the router has running on this engine
    # Their prompt tokens not expected in its prefix cache: on a prefill engine, the work queued.
    in_flight_tokens: int = 0
    # The uncached prompt tokens of a decode engine's requests sent it whole (no KV to pull) that
    # have not produced a token yet: the prompts it is prefilling itself. Each counts at least its
    # last token (never a cache hit), so 0 means none.
    local_prefill_tokens: int = 0
    retired: bool = False  # its DNS name no longer lists it: no new requests, dropped when idle
    # Recently sent prompt blocks (an LRU of chained block hashes): what its prefix cache may hold.
    recent_blocks: OrderedDict = field(default_factory=OrderedDict, repr=False)
    # Called when the engine goes down (the pool drops its KV index entries).
    on_down: Callable[[EngineHandle], None] | None = field(default=None, repr=False)
    # Set when a call marks it down: its health is then asked again (``EnginePool._follow``).
    recheck: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def __post_init__(self) -> None:
        self.session = EngineSession(
            self.stub, self.address, lambda: self.info.session_port if self.info is not None else 0
        )

    def remember_blocks(self, block_hashes: list) -> None:
        for block_hash in block_hashes:
            self.recent_blocks[block_hash] = None
            self.recent_blocks.move_to_end(block_hash)
        while len(self.recent_blocks) > MAX_REMEMBERED_BLOCKS:
            self.recent_blocks.popitem(last=False)

    def cached_prefix_blocks(self, block_hashes: list) -> int:
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self.recent_blocks:
                break
            count += 1
        return count

    @property
    def publishes_kv_events(self) -> bool:
        """Its last Info named a KV-event port."""
        return self.info is not None and self.info.kv_events_port > 0

    def mark_down(self, reason: str, recheck: bool = True) -> None:
        """Out of the rotation; ``recheck``: its health is asked again (not when the health
        stream itself said so: it reports the next change)."""
        if self.healthy:
            logger.warning("%s engine %s is down: %s", self.role, self.address, reason)
        self.healthy = False
        if recheck:
            self.recheck.set()
        if self.on_down is not None:
            self.on_down(self)


class EnginePool:
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        discovery_interval: float = DEFAULT_DISCOVERY_INTERVAL_S,
        dns_server: str | None = None,
        kv_events: KVEventTracker | None = None,
    ) -> None:
        self.sources = [
            EngineSource.parse(role, spec)
            for role, specs in (("prefill", prefill), ("decode", decode))
            for spec in specs
        ]
        self.discovery_interval = discovery_interval
        self.kv_events = kv_events  # follows every engine's KV-cache events (None: don't)
        self._publisher_seen = asyncio.Event()  # an engine has named a KV-event port
        self.resolver = Resolver(dns_server) if any(s.dns for s in self.sources) else None
        self.engines: list[EngineHandle] = []
        self._tasks: list[asyncio.Task] = []
        self._started = False
        self._followers: dict[EngineHandle, asyncio.Task] = {}  # {engine: its _follow task}
        for source in self.sources:
            if not source.dns:
                self._add(source.role, source.static_address())

    def _add(self, role: str, address: str) -> EngineHandle:
        options = [
            ("grpc.max_receive_message_length", 16 << 20),
            ("grpc.max_send_message_length", 16 << 20),
            # gRPC's default reconnect backoff grows to 120 s while an engine is down, so a
            # restarted engine could wait that long for the router's next attempt (and its
            # health check) to find it; capped near HEALTH_INTERVAL_S, it is found within ~1 s.
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.min_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", int(HEALTH_INTERVAL_S * 1000)),
        ]
        channel = grpc.aio.insecure_channel(address, options=options)
        stub = engine_pb2_grpc.EngineStub(channel)
        engine = EngineHandle(
            role=role,
            address=address,
            channel=channel,
            stub=stub,
            health=health_pb2_grpc.HealthStub(channel),
            on_down=self._engine_gone,
        )
        self.engines.append(engine)
        self._start_following(engine)
        return engine

    def _engine_gone(self, engine: EngineHandle) -> None:
        if self.kv_events is not None:
            self.kv_events.engine_gone(engine.address)

    def _engine_up(self, engine: EngineHandle) -> None:
        if self.kv_events is not None and engine.info is not None:
            info = engine.info
            if info.kv_events_port > 0:
                self._publisher_seen.set()
            self.kv_events.engine_up(
                engine.address, info.instance_id, info.kv_events_port, info.kv_events_replay_port
            )

    def of_role(self, role: str, healthy_only: bool = True) -> list[EngineHandle]:
        return [
            e for e in self.engines if e.role == role and not e.retired and (e.healthy or not healthy_only)
        ]

    async def discover(self) -> None:
        """Look every ``dns:`` entry up once and bring the pool in line with the answers."""
        if self.resolver is None:
            return
        wanted: dict[str, set[str]] = {}  # {role: addresses}
        for source in self.sources:
            if not source.dns:
                continue
            found = await self.resolver.addresses(source.host)
            if found is None:  # the lookup failed: keep what this role has
                wanted.setdefault(source.role, set()).update(
                    e.address for e in self.engines if e.role == source.role and not e.retired
                )
                continue
            wanted.setdefault(source.role, set()).update(grpc_address(ip, source.port) for ip in found)
        static = {(s.role, s.static_address()) for s in self.sources if not s.dns}
        for role, addresses in wanted.items():
            known = {e.address: e for e in self.engines if e.role == role}
            new = [self._add(role, address) for address in sorted(addresses - known.keys())]
            for engine in new:
                logger.info("%s engine %s discovered", role, engine.address)
            await asyncio.gather(*(self.check(engine) for engine in new))  # in rotation at once if SERVING
            for address, engine in known.items():
                listed = address in addresses or (role, address) in static
                if engine.retired and listed:
                    logger.info("%s engine %s is listed again", role, address)
                    engine.retired = False
                    if engine.healthy:
                        self._engine_up(engine)
                elif not engine.retired and not listed:
                    logger.info("%s engine %s is no longer listed: no new requests", role, address)
                    engine.retired = True
                    self._engine_gone(engine)
        await self._drop_retired()

    async def _drop_retired(self) -> None:
        for engine in [e for e in self.engines if e.retired and e.in_flight == 0]:
            logger.info("%s engine %s dropped from the pool", engine.role, engine.address)
            self.engines.remove(engine)
            self._engine_gone(engine)
            follower = self._followers.pop(engine, None)
            if follower is not None:
                follower.cancel()
            await engine.session.close()
            await engine.channel.close()

    async def check(self, engine: EngineHandle) -> None:
        """Ask its health once (a newly discovered engine: in rotation at once if SERVING)."""
        try:
            reply = await engine.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            await self._apply(engine, False, exc.code().name)
        else:
            await self._apply(engine, reply.status == health_pb2.HealthCheckResponse.SERVING, "not SERVING")

    async def _follow(self, engine: EngineHandle) -> None:
        """Follow ``engine``'s health on a Watch stream for as long as it is in the pool."""
        while True:
            engine.recheck.clear()
            call = engine.health.Watch(health_pb2.HealthCheckRequest(service=""))
            rechecking = asyncio.ensure_future(engine.recheck.wait())
            try:
                while True:
                    reading = asyncio.ensure_future(call.read())
                    await asyncio.wait({reading, rechecking}, return_when=asyncio.FIRST_COMPLETED)
                    if not reading.done():
                        # Marked down by a failed call while the stream says nothing new: the
                        # stream is opened again, and its first message is the status now.
                        reading.cancel()
                        break
                    reply = reading.result()
                    if reply is grpc.aio.EOF:
                        await self._apply(engine, False, "its health stream ended")
                        break
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    await self._apply(engine, serving, "not SERVING", watched=True)
            except grpc.aio.AioRpcError as exc:
                await self._apply(engine, False, exc.code().name)
            except Exception:
                logger.exception("following the health of engine %s failed; trying again", engine.address)
            finally:
                rechecking.cancel()
                call.cancel()
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def _apply(self, engine: EngineHandle, serving: bool, reason: str, watched: bool = False) -> None:
        """What a health answer means for the rotation (and, when SERVING, the engine's Info).
        ``watched``: the answer came on the engine's Watch stream, which reports the next change
        itself; an answer that took it out otherwise (a Check, a failed Info) asks again."""
        # An engine publishing KV events is asked every time: restarted between two checks, it
        # has a new instance id (and event ports), and its old index entries must go.
        publishes = self.kv_events is not None and engine.publishes_kv_events
        if serving and (engine.info is None or not engine.healthy or publishes):
            try:
                engine.info = await engine.stub.Info(engine_pb2.InfoRequest(), timeout=HEALTH_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                serving, reason, watched = False, f"Info failed: {exc.code().name}", False
            else:
                if not engine.retired:
                    self._engine_up(engine)  # a new instance id: its old entries go
        if serving and not engine.healthy:
            logger.info("%s engine %s is healthy", engine.role, engine.address)
            engine.recent_blocks.clear()  # it may have restarted with an empty prefix cache
        if not serving:
            engine.mark_down(reason, recheck=not watched)
        engine.healthy = serving

    def _start_following(self, engine: EngineHandle) -> None:
        if self._started and engine not in self._followers:
            self._followers[engine] = asyncio.create_task(
                self._follow(engine), name=f"engine-health-{engine.address}"
            )

    async def _watch_dns(self) -> None:
        while True:
            try:
                await self.discover()
            except Exception:
                logger.exception("engine discovery failed; trying again")
            await asyncio.sleep(self.discovery_interval)

    async def _poll_kv_publishers(self) -> None:
        """Ask every healthy engine that publishes KV events for its Info once a second, as
        health checks did before the Watch streams: restarted between two looks (a new instance
        id), its old index entries go, and an event stream that failed starts over. Until an
        engine has named an event port, wait without waking (engines do not publish by default)."""
        while True:
            await self._publisher_seen.wait()
            await asyncio.sleep(HEALTH_INTERVAL_S)
            publishers = [e for e in self.engines if e.healthy and e.publishes_kv_events]
            await asyncio.gather(*(self.check(e) for e in publishers), return_exceptions=True)

    def start(self) -> None:
        self._started = True
        for engine in self.engines:
            self._start_following(engine)
        self._tasks = []
        if self.kv_events is not None:
            self._tasks.append(asyncio.create_task(self._poll_kv_publishers(), name="kv-publishers"))
        if self.resolver is not None:
            self._tasks.append(asyncio.create_task(self._watch_dns(), name="engine-discovery"))

    async def close(self) -> None:
        for task in [*self._tasks, *self._followers.values()]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.kv_events is not None:
            self.kv_events.close()
        for engine in self.engines:
            await engine.session.close()
            await engine.channel.close()
