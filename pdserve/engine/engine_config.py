"""Everything an engine core process needs to start, as one JSON-serialisable object."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from pdserve.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    kv_transfer: KVTransferConfig | None = None

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
        )
