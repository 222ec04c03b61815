"""The one KV cache layout every part of pdserve agrees on.

``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: a block holds K and V of
``block_size`` tokens for *all* layers, contiguously. A transfer therefore moves one contiguous
region per block (one NIXL descriptor, one UCX/TCP message segment), and the handshake compares
``fingerprint()`` so two engines never exchange blocks they would read differently.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``torch.float32`` -> ``torch.float32``; anything else is a ValueError."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype: unsupported {name}")
        return name
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {name!r}") from None


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of one engine's paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block (all layers): ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        numel = 1
        for dim in self.block_shape:
            numel *= dim
        return numel * self.torch_dtype.itemsize

    def allocate(
        self, num_blocks: int, device: str | torch.device = "cpu", shared: bool = False
    ) -> torch.Tensor:
        """A zeroed cache tensor of ``num_blocks`` blocks in this layout.

        ``shared``: in host memory another process on this host can map (the ``shm`` transport
        serves reads that way).
        """
        if shared:
            if torch.device(device).type != "cpu":
                raise ValueError(f"a shared KV cache lives in host memory, not on {device}")
            from pdserve.engine.shared_memory import allocate_shared

            return allocate_shared((num_blocks, *self.block_shape), self.torch_dtype)
        return torch.zeros((num_blocks, *self.block_shape), dtype=self.torch_dtype, device=device)

    def fingerprint(self) -> dict:
        """What a peer must match before blocks are exchanged (sent in the handshake)."""
        return asdict(self)
