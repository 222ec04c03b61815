"""The C kernels' build (``kernels/cpu/build.py``): no compiler warning on any instruction set.

Every source under ``kernels/cpu/csrc/`` is compiled with the build's own flags (``-Wall -Wextra
-Wundef``) and ``-Werror``, for this CPU (``-march=native``) and for machines of other kinds, so
that each branch of ``csrc/isa.h`` is compiled by one of them: AVX2 without AVX-512
(``x86-64-v3``), no vector extension at all (``x86-64``), AVX-512 Foundation alone (``knl``),
AVX-512 without AVX512-BF16 or VNNI (``skylake-avx512``), and with VNNI but no BF16
(``icelake-server``). Each library's objects are then linked with every symbol resolved, so that
a kernel whose native version and portable twin (``csrc/arch_fallback.h``) disagree on a build
fails here rather than when an engine loads it; and what the libraries export starts with pd_.
Compile and link only: nothing runs.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.kernels.cpu import build as cpu_build
from pdserve.kernels.cpu import causal_attention, decoder_layer, layer_ops, paged_attention, quant

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None, reason="no C compiler to build the kernels")

LIBRARIES = {
    module.__name__.rsplit(".", 1)[1]: module.KERNELS
    for module in (quant, paged_attention, causal_attention, layer_ops, decoder_layer)
}
X86 = platform.machine().lower() in ("x86_64", "amd64")
OTHER_MARCHES = ["x86-64-v3", "x86-64", "knl", "skylake-avx512", "icelake-server"] if X86 else []
# Every symbol resolved at link time (GNU and LLVM linkers on Linux).
NO_UNDEFINED = ["-Wl,-z,defs"] if sys.platform.startswith("linux") else []


def _compile_all(march: str, out: Path) -> dict[Path, Path]:
    """Each source's object for ``-march=<march>``, or the test fails with the compiler's words."""
    cc = cpu_build.compiler()
    assert cc is not None
    probe = subprocess.run(
        [cc, f"-march={march}", "-x", "c", "-c", "-o", os.devnull, "-"],
        input="",
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0 or probe.stderr.strip():  # unknown, or on its way out of the compiler
        pytest.skip(f"{cc} does not take -march={march}: {probe.stderr.strip()}")
    compile_flags = [flag for flag in cpu_build.flags(march) if flag != "-shared"]
    objects, problems = {}, []
    for source in sorted(cpu_build.SOURCES.rglob("*.c")):
        name = str(source.relative_to(cpu_build.SOURCES))
        objects[source] = out / (name.replace("/", "_") + ".o")
        cmd = [
            cc,
            *compile_flags,
            "-Werror",
            *cpu_build.INCLUDES,
            "-c",
            str(source),
            "-o",
            str(objects[source]),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or result.stderr.strip():
            problems.append(f"{name} (-march={march}):\n{result.stderr}")
    assert not problems, "\n".join(problems)
    return objects


def _link(name: str, objects: list[Path], out: Path) -> Path:
    cc = cpu_build.compiler()
    assert cc is not None
    library = out / f"lib{name}.so"
    cmd = [cc, "-shared", "-fopenmp", *map(str, objects), "-o", str(library), *NO_UNDEFINED, *cpu_build.LIBS]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"linking {name}: {result.stderr}"
    return library


def test_every_source_is_in_a_library_and_every_library_finds_its_sources():
    linked = {source for library in LIBRARIES.values() for source in library.sources}
    assert linked == set(cpu_build.SOURCES.rglob("*.c"))
    assert all(source.exists() for source in linked)


@pytest.mark.parametrize("march", ["native", *OTHER_MARCHES])
def test_the_kernels_build_without_a_warning_and_link_whole(march, tmp_path):
    objects = _compile_all(march, tmp_path)
    for name, library in LIBRARIES.items():
        path = _link(name, [objects[source] for source in library.sources], tmp_path)
        if march == "native":
            _check_exports(name, path)


def _check_exports(name: str, library: Path) -> None:
    """What the bindings load and what a family's files call across files is pd_*; the rest is
    static."""
    if shutil.which("nm") is None:
        return
    listed = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    functions = [line.split()[-1] for line in listed.stdout.splitlines() if line.split()[-2:-1] == ["T"]]
    assert functions, f"{name}: no functions exported"
    others = [
        symbol for symbol in functions if not symbol.startswith("pd_") and symbol not in ("_init", "_fini")
    ]
    assert others == [], f"{name} exports {others}"


def test_the_cache_key_covers_every_header_and_the_flags(monkeypatch, tmp_path):
    """A change to any header under csrc/ (arch/ ones included), or to the flags, is a new build."""
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_build.SOURCES, copy)
    monkeypatch.setattr(cpu_build, "SOURCES", copy)
    sources = cpu_build.sources("quants")
    first = cpu_build.cache_key(sources, "cc 1.0")
    assert cpu_build.cache_key(sources, "cc 1.0") == first
    assert cpu_build.cache_key(sources, "cc 1.1") != first
    for header in sorted(copy.rglob("*.h")):
        original = header.read_bytes()
        header.write_bytes(original + b"\n")
        assert cpu_build.cache_key(sources, "cc 1.0") != first, header
        header.write_bytes(original)
    assert cpu_build.cache_key(sources, "cc 1.0") == first
    monkeypatch.setattr(cpu_build, "WARNINGS", [*cpu_build.WARNINGS, "-Wshadow"])
    assert cpu_build.cache_key(sources, "cc 1.0") != first


def test_pdserve_kernel_march_builds_for_another_cpu_under_its_own_key(monkeypatch):
    """``PDSERVE_KERNEL_MARCH=x86-64-v3`` builds the AVX2 paths (tests on an AVX-512 machine), as
    a library of its own beside the native one."""
    monkeypatch.delenv(cpu_build.MARCH_ENV, raising=False)
    sources = cpu_build.sources("quants")
    assert "-march=native" in cpu_build.flags()
    native = cpu_build.cache_key(sources, "cc 1.0")
    monkeypatch.setenv(cpu_build.MARCH_ENV, "x86-64-v3")
    assert cpu_build.target_march() == "x86-64-v3"
    assert "-march=x86-64-v3" in cpu_build.flags() and "-march=native" not in cpu_build.flags()
    assert cpu_build.cache_key(sources, "cc 1.0") != native
