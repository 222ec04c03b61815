"""pdserve: disaggregated prefill/decode LLM serving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pdserve.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy: `import pdserve` (the CLI, the router) must not pay for torch.
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")


__all__ = ["LLM", "__version__"]
