"""Engine configuration, validated up front like vLLM's config classes.

Every invalid value or combination raises ``ValueError`` naming the fields involved, so a bad
command line fails before any model is loaded. ``EngineConfig`` bundles them for the engine core
process. (A checkpoint's architecture numbers are ``pdserve.engine.model.arch.ModelArchConfig``.)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

SCHEDULING_POLICIES = ("fcfs", "priority")
KV_ROLES = ("producer", "consumer", "both")
KV_TRANSPORTS = ("auto", "tcp", "ucx", "nixl", "shm")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
HANDOVER_STEPS = ("joined", "separate", "inflight")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
# How the weights are held: dense in the dtype, a GGUF file's own quantized blocks, or int8
# blocks made at load (pdserve.engine.model.weights.quantize_int8); "auto" (the default) serves a GGUF
# file's blocks as they are where the kernels run (pdserve.engine.model.loader.resolve_quantization).
# The "-a8" modes hold the weights the same way and, opt-in, quantize the activations to int8 per
# 32 inside the decode matmuls (llama.cpp's Q8_1; pdserve/kernels/cpu/csrc/quants_a8.c).
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8", "gguf-a8", "int8-a8")
INT8_ACTIVATIONS_SUFFIX = "-a8"
# Set the defaults of ``--dtype`` / ``LLM(dtype=...)`` and ``--quantization`` for every engine
# started from this environment (a test suite that compares tokens with transformers' dense fp32
# pins float32 and none this way).
DTYPE_ENV = "PDSERVE_DTYPE"
QUANTIZATION_ENV = "PDSERVE_QUANTIZATION"


def default_dtype() -> str:
    """``$PDSERVE_DTYPE`` if set, else ``"auto"``."""
    return os.environ.get(DTYPE_ENV, "").strip() or "auto"


def default_quantization() -> str:
    """``$PDSERVE_QUANTIZATION`` if set, else ``"auto"``."""
    return os.environ.get(QUANTIZATION_ENV, "").strip() or "auto"


def split_quantization(name: str) -> tuple[str, bool]:
    """``"gguf-a8"`` -> ``("gguf", True)``: how the weights are held, and whether the decode
    matmuls quantize activations to int8 (``"gguf"`` -> ``("gguf", False)``)."""
    if name.endswith(INT8_ACTIVATIONS_SUFFIX):
        return name.removesuffix(INT8_ACTIVATIONS_SUFFIX), True
    return name, False


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class SchedulerConfig:
    """How the scheduler batches work (vLLM v1's ``SchedulerConfig`` subset)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # A prefill longer than this is chunked to this many tokens per step (0: no limit), so one
    # long prompt cannot starve the running decodes.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # What the scheduler does when a remote KV load fails: recompute the prompt locally, or
    # finish the request with FINISHED_ERROR.
    kv_load_failure_policy: str = "recompute"
    # A request whose remote KV has just landed (a decode engine's handover): "inflight" (the
    # default) lets it join the step in flight between two decoder layers while that step is
    # at most half done, its missed layers run alone first (engine core with a connector);
    # "joined" runs it in the next batch step with everyone (vLLM's behaviour); "separate"
    # first runs a small step of the landed requests alone, which every running request then
    # waits. See Scheduler and EngineCore.
    handover_step: str = "inflight"

    def __post_init__(self) -> None:
        _require_positive(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with enable_chunked_prefill=False: "
                "the longest prompt could never be scheduled. Raise max_num_batched_tokens, "
                "lower max_model_len or enable chunked prefill."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than "
                f"or equal to max_num_seqs ({self.max_num_seqs}): every running sequence needs "
                "at least one token per step."
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold!r}"
            )
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must not "
                f"exceed max_model_len ({self.max_model_len})"
            )
        if self.handover_step not in HANDOVER_STEPS:
            raise ValueError(f"handover_step must be one of {HANDOVER_STEPS}, got {self.handover_step!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}"
            )


@dataclass
class CacheConfig:
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens each."""

    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require_positive(block_size=self.block_size, num_blocks=self.num_blocks)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")


@dataclass
class ModelConfig:
    """Which weights to load and in what dtype (``path=None``: the bundled SmolLM2-135M)."""

    path: str | None = None
    # "auto": bf16 where the CPU multiplies it natively, else fp32 (resolved by the process that
    # loads the weights: ``pdserve.engine.cpu_resources.resolve_dtype``).
    dtype: str = field(default_factory=default_dtype)
    # Activations between ops and the KV cache stay in ``dtype`` whatever this is (the "-a8"
    # modes quantize x to int8 inside the decode matmuls only). "auto": resolved by the process
    # that loads the weights (``loader.resolve_quantization``).
    quantization: str = field(default_factory=default_quantization)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}")
        # (A directory may hold one .gguf file: the loader resolves it.)
        path = self.path
        held, _ = split_quantization(self.quantization)
        if held == "gguf" and path and not path.endswith(".gguf") and not os.path.isdir(path):
            raise ValueError(f"quantization {self.quantization!r} needs a .gguf model file, got {path!r}")


@dataclass
class KVTransferConfig:
    """How an engine exchanges KV blocks with its peers (the P/D connector's settings)."""

    role: str = "both"
    transport: str = "auto"
    engine_id: str = ""
    host: str = "127.0.0.1"  # bind address of the side channel and the tcp transport
    # The address peers should use to reach this engine (a container's service name, say);
    # defaults to ``host``.
    advertise_host: str | None = None
    side_channel_port: int = 0  # 0: pick a free port at start-up
    # Prefill holds finished requests' blocks this long unless decode renews or releases them.
    lease_ms: int = 30_000
    transfer_timeout_s: float = 10.0
    cluster_token: str | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"role must be one of {KV_ROLES}, got {self.role!r}")
        if self.transport not in KV_TRANSPORTS:
            raise ValueError(f"transport must be one of {KV_TRANSPORTS}, got {self.transport!r}")
        _require_positive(lease_ms=self.lease_ms)
        if not self.transfer_timeout_s > 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {self.transfer_timeout_s!r}")
        if self.host in ("0.0.0.0", "::") and not self.advertise_host:
            raise ValueError(f"advertise_host is required when host is the wildcard {self.host!r}")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port must be in [0, 65535], got {self.side_channel_port}")

    @property
    def reachable_host(self) -> str:
        return self.advertise_host or self.host


@dataclass
class KVEventsConfig:
    """Where an engine publishes its KV-cache events (``pdserve.engine.kv_events``): a PUB
    socket on ``port`` and its replay ROUTER socket on ``port + 1``; port 0 picks two free
    ports (the engine's Info says which)."""

    host: str = "127.0.0.1"
    port: int = 0
    buffer_steps: int = 10_000  # batches kept for replay

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65535:
            raise ValueError(f"kv_events port must be in [0, 65534] (replay uses port + 1), got {self.port}")
        _require_positive(buffer_steps=self.buffer_steps)

    @property
    def replay_port(self) -> int:
        return self.port + 1 if self.port else 0


@dataclass
class EngineConfig:
    """Everything an engine core process needs to start, as one JSON-serialisable object."""

    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    kv_transfer: KVTransferConfig | None = None
    threads: int = 0  # torch intra-op threads of the core; 0: from the CPUs it may use
    kv_events: KVEventsConfig | None = None  # None: no KV-cache events (the default)
    # CPUs the core process (the model's steps, torch's threads) is pinned to; None: wherever the
    # front may run. The front (gRPC, streaming) is not pinned with it: see pdserve.cluster.
    core_cpus: list[int] | None = None
    # The cpu board this engine shares with the other engines of its machine, and its slot there
    # (pdserve.engine.cpu_lending): it borrows their cores while they are idle. None: no lending.
    cpu_board: str | None = None
    cpu_board_slot: int = 0

    def __post_init__(self) -> None:
        if self.core_cpus is not None and (not self.core_cpus or min(self.core_cpus) < 0):
            raise ValueError(f"core_cpus must name cpus, got {self.core_cpus}")
        if self.cpu_board_slot < 0:
            raise ValueError(f"cpu_board_slot must be >= 0, got {self.cpu_board_slot}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        data = json.loads(text)
        kv = data.get("kv_transfer")
        return cls(
            model=ModelConfig(**data["model"]),
            scheduler=SchedulerConfig(**data["scheduler"]),
            cache=CacheConfig(**data["cache"]),
            kv_transfer=KVTransferConfig(**kv) if kv else None,
            threads=int(data.get("threads", 0)),
            kv_events=KVEventsConfig(**data["kv_events"]) if data.get("kv_events") else None,
            core_cpus=[int(c) for c in data["core_cpus"]] if data.get("core_cpus") is not None else None,
            cpu_board=data.get("cpu_board"),
            cpu_board_slot=int(data.get("cpu_board_slot", 0)),
        )
