"""The CPU engine's C kernels (``kernels/cpu/csrc/``): each library built once per machine, and loaded.

The sources are laid out as ggml-cpu's: a family of kernels is ``csrc/<family>.c`` (its entry
points and its portable C) and, where it has them, ``csrc/arch/x86/<family>.c`` (the same kernels
in x86 vector instructions), each native function the twin of a portable ``NAME_generic`` that
``csrc/arch_fallback.h`` puts in its place where the build lacks the instructions it needs
(``csrc/isa.h`` says which a build has). A library is one or more families (``sources``).

A library is compiled at first use with the host's C compiler and ``-march=native`` into
``~/.cache/pdserve/kernels/<hash>/`` (about a second), keyed by its sources, every header, the
compiler, the CPU's flags and the build's, so a machine of another kind builds its own copy.
``PDSERVE_KERNEL_MARCH`` names another ``-march`` (``target_march()``): ``x86-64-v3`` builds the
paths of a CPU with AVX2 and no AVX-512 on any CPU that has AVX2, so that they can be tested on
an AVX-512 machine; ``x86-64`` the portable C alone.

The kernels are called through ``ctypes`` on tensors' data pointers: they need no torch headers,
which would cost a minute of compile time per build. Where no compiler is found, or the build
fails, ``available()`` is False and the callers run their torch reference (correct, slower); the
reason is logged once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve.kernels.cpu.features import cpu_flags

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=c11"]
# Warnings on: the sources build without one on every instruction set they have a path for
# (tests/kernels hold that with -Werror); here a compiler's new warning is logged, not fatal.
WARNINGS = ["-Wall", "-Wextra", "-Wundef"]
MARCH_ENV = "PDSERVE_KERNEL_MARCH"
INCLUDES = ["-I", str(SOURCES)]  # csrc/arch/*/ include csrc's headers by name
LIBS = ["-lm"]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cache_dir() -> Path:
    """``$PDSERVE_KERNEL_CACHE``, else ``~/.cache/pdserve/kernels``; a temporary directory where
    that cannot be written (a container with a read-only root filesystem and a writable /tmp)."""
    chosen = Path(os.environ.get("PDSERVE_KERNEL_CACHE", Path.home() / ".cache" / "pdserve" / "kernels"))
    try:
        chosen.mkdir(parents=True, exist_ok=True)
        if os.access(chosen, os.W_OK):
            return chosen
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"pdserve-kernels-{os.getuid()}"


def target_march() -> str:
    """The ``-march`` the libraries are built for: ``$PDSERVE_KERNEL_MARCH``, else ``native``
    (read at each build; a process loads each library once)."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def flags(march: str | None = None) -> list[str]:
    """The compiler's flags of a build for ``-march=<march>`` (default ``target_march()``): all but
    its paths, and all in the build's cache key."""
    return [*CFLAGS, f"-march={march or target_march()}", *WARNINGS, "-shared"]


def sources(*families: str, root: Path | None = None) -> list[Path]:
    """The C files of ``families``: for each, ``csrc/<family>.c`` and its ISA variants
    ``csrc/arch/<arch>/<family>.c`` (each compiles to nothing where the build's instruction
    sets lack what it needs). ``root``: another ``csrc/`` (the router's), built the same way."""
    root = root or SOURCES  # read at the call: tests point SOURCES at a copy
    found = []
    for family in families:
        found.append(root / f"{family}.c")
        found.extend(sorted(root.glob(f"arch/*/{family}.c")))
    return found


def _files_key(paths: Sequence[Path], root: Path) -> bytes:
    """Each file's path under csrc/ and its bytes: a renamed file changes the key too."""
    return b"".join(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() for path in paths)


def cache_key(sources: Sequence[Path], compiler_version: str, root: Path | None = None) -> str:
    """What a build's library is keyed by: its sources and every header under csrc/ (each with its
    path), the compiler's version, the CPU's flags and the build's flags."""
    root = root or SOURCES
    return hashlib.sha256(
        _files_key(sources, root)
        + _files_key(sorted(root.rglob("*.h")), root)
        + compiler_version.encode()
        + " ".join(sorted(cpu_flags())).encode()
        + " ".join(flags() + LIBS).encode()
    ).hexdigest()[:16]


def build(sources: Sequence[Path], cc: str, root: Path | None = None) -> Path:
    """Compile ``sources`` into one shared library once per (sources, every header under csrc/,
    compiler, CPU, flags) and return its path; the library is named after the first source."""
    root = root or SOURCES
    source = sources[0]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    target = cache_dir() / cache_key(sources, version, root) / f"libpdserve_{source.stem}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: engines starting together never load a half-written file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *flags(), "-I", str(root), *map(str, sources), "-o", partial, *LIBS]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    names = " + ".join(str(path.relative_to(root)) for path in sources)
    if result.returncode != 0:
        os.unlink(partial)
        raise RuntimeError(f"building {names} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
    os.replace(partial, target)
    logger.info("built the CPU kernels of %s: %s", names, target)
    if result.stderr.strip():
        logger.info("the compiler's warnings on %s:\n%s", names, result.stderr[-2000:])
    return target


class CLibrary:
    """The families of kernels ``families`` (``sources``: the first one's, and those of the
    families whose functions it calls, linked into the same library), built and loaded on first
    use (once per process).

    ``declare`` sets the loaded library's functions' ``argtypes`` and ``restype``; ``purpose``
    names what falls back to the torch reference when the library cannot be had (``fallback``:
    what runs instead, in the log line); ``root``: the ``csrc/`` the families are in.
    """

    def __init__(
        self,
        families: Sequence[str],
        declare: Callable[[ctypes.CDLL], None],
        purpose: str,
        root: Path | None = None,
        fallback: str = "the torch reference runs",
    ) -> None:
        self.root = root
        self.fallback = fallback
        self.sources = sources(*families, root=root)
        self.declare = declare
        self.purpose = purpose
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None = None
        self._load_error: str | None = None

    def load(self) -> ctypes.CDLL:
        """The loaded library (built on first call); raises ``RuntimeError`` when it cannot be."""
        library = self._library
        if library is not None:  # the per-call path of every kernel: no lock once loaded
            return library
        with self._lock:
            if self._library is None and self._load_error is None:
                cc = compiler()
                try:
                    if cc is None:
                        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
                    lib = ctypes.CDLL(str(build(self.sources, cc, self.root)))
                    self.declare(lib)
                except (RuntimeError, OSError, AttributeError) as exc:
                    self._load_error = str(exc)
                    logger.warning("%s: C kernels unavailable (%s); %s", self.purpose, exc, self.fallback)
                else:
                    self._library = lib
            if self._library is None:
                raise RuntimeError(f"{self.purpose}: C kernels unavailable: {self._load_error}")
            return self._library

    def available(self) -> bool:
        """True when the library builds and loads here (``load`` logs, once, why it does not)."""
        try:
            self.load()
        except RuntimeError:
            return False
        return True
