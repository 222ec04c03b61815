"""The model package's layering: ``pdserve/engine/model/layers/`` is a leaf, and a model family
(``llama.py``, ``qwen3.py``, ``gemma3.py``) is built from layers, the other families building on
Llama's classes.

A layer module imports nothing of the model but other layers and the architecture numbers: no
family, no loader, no ``weights.py`` (which walk whole models and import the layers). ``llama.py``
imports the layers only; another family the layers and ``llama.py``, never a third family or a
loader. Every import counts, at the top, inside a function (lazy)
or under ``TYPE_CHECKING``: each is an edge a circle can close through. Read from the AST,
nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "pdserve" / "engine" / "model"
LAYERS = MODEL / "layers"
LAYER_MODULES = {"activation", "attention", "linear", "norm", "quant_linear", "rotary"}
# What of pdserve a layer may import (a prefix: the module or one under it).
LAYER_MAY_IMPORT = (
    "pdserve.kernels",
    "pdserve.engine.kv_layout",
    "pdserve.engine.model.arch",
    "pdserve.engine.model.layers",
)
# Model families, one module each beside llama.py, and what of pdserve they may import.
FAMILIES = ("llama", "qwen3", "gemma3")
FAMILY_MAY_IMPORT = {
    "llama": LAYER_MAY_IMPORT,
    **{family: (*LAYER_MAY_IMPORT, "pdserve.engine.model.llama") for family in FAMILIES[1:]},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of everything ``source`` (the text of ``module``) imports, at any
    depth of the tree; ``from a import b`` gives ``a.b`` (``b`` may be a module), relative
    imports are resolved against ``module``."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(path: Path, may_import: tuple[str, ...]) -> list[str]:
    """``file:line name`` for each import of pdserve by ``path`` outside ``may_import``."""
    out = []
    imports = imported_modules(path.read_text(), module_name(path), path.name == "__init__.py")
    for line, name in imports:
        if name != "pdserve" and not name.startswith("pdserve."):
            continue  # torch, the standard library
        if not any(name == allowed or name.startswith(allowed + ".") for allowed in may_import):
            out.append(f"{path.relative_to(ROOT)}:{line} {name}")
    return out


def test_the_layers_import_nothing_of_the_model():
    modules = sorted(LAYERS.rglob("*.py"))
    assert {p.stem for p in modules} >= LAYER_MODULES, f"layer modules missing from {LAYERS}"
    found = [v for path in modules for v in violations(path, LAYER_MAY_IMPORT)]
    assert not found, "layers import the model:\n" + "\n".join(found)


def test_a_model_family_imports_layers_not_loaders():
    found = [v for family in FAMILIES for v in violations(MODEL / f"{family}.py", FAMILY_MAY_IMPORT[family])]
    assert not found, "a model family imports more than its layers:\n" + "\n".join(found)


def test_the_checker_sees_lazy_type_checking_and_relative_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from pdserve.kernels.cpu import quant\n"
        "if TYPE_CHECKING:\n"
        "    from pdserve.engine.model.llama import LlamaForCausalLM\n"
        "def f():\n"
        "    from ..weights import build_model\n"
        "    from . import norm\n"
        "    import pdserve.engine.model.loader\n"
    )
    names = [name for _, name in imported_modules(source, "pdserve.engine.model.layers.linear")]
    assert sorted(names) == sorted(
        [
            "typing.TYPE_CHECKING",
            "torch",
            "pdserve.kernels.cpu.quant",
            "pdserve.engine.model.llama.LlamaForCausalLM",
            "pdserve.engine.model.weights.build_model",
            "pdserve.engine.model.layers.norm",
            "pdserve.engine.model.loader",
        ]
    )


def test_every_family_has_a_module_and_a_class():
    from pdserve.engine.model.arch import MODEL_TYPE_FAMILIES
    from pdserve.engine.model.gguf_loader import GGUF_ARCHS
    from pdserve.engine.model.weights import MODEL_FAMILIES

    assert set(MODEL_FAMILIES) == set(FAMILIES)
    assert set(MODEL_TYPE_FAMILIES.values()) == set(FAMILIES)
    assert {arch.family for arch in GGUF_ARCHS.values()} == set(FAMILIES)
    assert all((MODEL / f"{family}.py").exists() for family in FAMILIES)
