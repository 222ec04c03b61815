"""Huge pages for an engine core (``pdserve.engine.huge_pages``): the kernel's mode read, the
environment a core gets (and a user's own tunables kept), the option through the engine's
command line to the core process, and a real process's memory landing on huge pages."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.huge_pages import GLIBC_TUNABLE, core_env, resident_huge_bytes, thp_mode


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("", "unavailable"),
    ],
)
def test_thp_mode_is_the_selected_one(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert thp_mode(path) == mode


def test_thp_mode_without_the_file_is_unavailable(tmp_path):
    assert thp_mode(tmp_path / "missing") == "unavailable"


def test_core_env_asks_glibc_for_huge_pages_where_the_kernel_gives_them_on_request():
    assert core_env(True, {}, mode="madvise") == {"GLIBC_TUNABLES": f"{GLIBC_TUNABLE}=1"}
    assert core_env(True, {}, mode="always") == {"GLIBC_TUNABLES": f"{GLIBC_TUNABLE}=1"}
    assert core_env(True, {}, mode="never") == {}
    assert core_env(True, {}, mode="unavailable") == {}
    assert core_env(False, {}, mode="madvise") == {}


def test_core_env_keeps_the_users_tunables_and_their_own_choice():
    environ = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert core_env(True, environ, mode="madvise") == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{GLIBC_TUNABLE}=1"
    }
    # Their own hugetlb setting (0: off, 2: hugetlbfs pages) stands.
    assert core_env(True, {"GLIBC_TUNABLES": f"{GLIBC_TUNABLE}=0"}, mode="madvise") == {}


def test_the_engine_option_reaches_the_core_process_config():
    from pdserve.engine.server import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    on = engine_config_from_args(parser.parse_args(["--port", "1"]), None)
    off = engine_config_from_args(parser.parse_args(["--port", "1", "--no-huge-pages"]), None)
    assert on.huge_pages is True and off.huge_pages is False
    assert EngineConfig.from_json(off.to_json()).huge_pages is False
    assert EngineConfig.from_json(on.to_json()).huge_pages is True


# A process that fills 64 MiB through malloc, as the weights and the KV cache are, and says how
# much of its memory is on huge pages.
_FILL = """
import sys
from pdserve.engine.huge_pages import resident_huge_bytes
buffer = bytearray(b"\\x01") * (64 << 20)
print(resident_huge_bytes()[0])
"""


def _huge_bytes_of_a_process(extra_env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    result = subprocess.run(
        [sys.executable, "-c", _FILL], env={**env, **extra_env}, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.mark.skipif(
    thp_mode() not in ("madvise", "always"), reason="the kernel gives no huge pages on request"
)
def test_a_core_environment_puts_malloc_memory_on_huge_pages():
    asked = _huge_bytes_of_a_process(core_env(True, {}))
    assert asked >= 32 << 20
    if thp_mode() == "madvise":
        # Not asked: only what the process asks for itself (nothing here).
        assert _huge_bytes_of_a_process({}) < 32 << 20


def test_resident_huge_bytes_of_this_process():
    huge, resident = resident_huge_bytes()
    assert resident > 0 and 0 <= huge <= resident
    assert resident_huge_bytes(2**22 + 12345) == (0, 0)  # no such process
