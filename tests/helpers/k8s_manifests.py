"""The Kubernetes manifests as built by ``kubectl kustomize``, and their containers' command
lines, for tests that validate them and run them as local processes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
BASE = ROOT / "deploy" / "kubernetes"
GPU_OVERLAY = BASE / "overlays" / "gpu"


def build(path: Path = BASE) -> list[dict[str, Any]]:
    """Every object ``kubectl kustomize PATH`` builds (skips the test if kubectl is missing)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: kustomize builds cannot be checked here")
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container_argv(docs: list[dict[str, Any]], deployment: str) -> list[str]:
    """``command + args`` of the deployment's first container, without the leading ``pdserve``."""
    container = find(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]
    argv = list(container.get("command", [])) + list(container.get("args", []))
    assert argv[0] == "pdserve", argv
    return argv[1:]


def substitute(argv: list[str], replacements: dict[str, str]) -> list[str]:
    """Replace whole ``--flag=value`` arguments by flag name and expand ``$(VAR)`` references."""
    out = []
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in replacements:
            arg = f"{flag}={replacements[flag]}"
        for var, value in replacements.items():
            arg = arg.replace(f"$({var})", value)
        out.append(arg)
    return out
