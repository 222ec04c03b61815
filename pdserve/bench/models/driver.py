"""``pdserve bench models``: make the model files of issue 41 into the model cache, or keep them.

For each file asked for (``--only``; default all), and what it needs first: kept when the
manifest says it is there, whole, and made with the same key; otherwise made at a ``.partial``
path by its recipe, renamed into place, hashed, and recorded in ``manifest.json`` with the
commands that made it. One line per file on stdout: name, path, size, the share of its tensor
bytes by type, and whether it was made (how long it took) or kept. Progress and the tools'
set-up go to stderr; the tools' own output to ``make.log`` in the cache.

llama.cpp (``llama-quantize``) is built once in the peers' cache when a file needs it and it is
not there (``ensure_llamacpp``, about 20 minutes on 2 cores); ``--rebuild-llamacpp`` builds it
again. The 1B-shaped model takes 1.5 to 3 minutes on 2 cores (its random init, the converter, the
quantizer: about 20, 20 and 30 s when nothing else runs) and at most about 5 GB of memory (the
random init, in fp32).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import sys
import time
from datetime import UTC, datetime

from pdserve.bench.models.manifest import Entry, Manifest, directory_files, directory_sha256, sha256_file
from pdserve.bench.models.paths import CACHE_ENV, cache_dir
from pdserve.bench.models.recipes import RECIPES, Recipe, Workshop, with_needs
from pdserve.bench.models.tensor_types import gguf_type_bytes, human_bytes, safetensors_type_bytes, shares
from pdserve.bench.peers import side_venv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench models",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="files:\n" + "\n".join(f"  {r.name}: {r.summary}" for r in RECIPES.values()),
    )
    p.add_argument(
        "--cache", default=None, help=f"the model cache (default: ${CACHE_ENV}, else ~/.cache/pdserve/models)"
    )
    p.add_argument("--only", nargs="+", choices=list(RECIPES), default=None, metavar="NAME",
                   help="make these (and what they need) rather than every file")  # fmt: skip
    p.add_argument("--rebuild", action="store_true", help="make the files asked for again, even if kept")
    p.add_argument(
        "--peer-cache", default=None, help="where llama.cpp is built (default: ~/.cache/pdserve/peers)"
    )
    p.add_argument("--rebuild-llamacpp", action="store_true", help="build llama.cpp again first")
    p.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-quantize's threads"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads < 1:
        print("error: --threads must be positive", file=sys.stderr)
        return 2

    def say(message: str) -> None:
        print(f"[bench models] {message}", file=sys.stderr, flush=True)

    cache = cache_dir(args.cache)
    os.makedirs(cache, exist_ok=True)
    workshop = Workshop(cache, side_venv.cache_dir(args.peer_cache), say, args.threads, args.rebuild_llamacpp)
    asked = args.only or list(RECIPES)
    with open(os.path.join(cache, ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"error: another `pdserve bench models` is running on {cache}", file=sys.stderr)
            return 2
        manifest = Manifest.load(cache)
        try:
            if args.rebuild_llamacpp:  # asked for even when every file is kept
                workshop.quantizer()
            for name in with_needs(asked):
                recipe = RECIPES[name]
                entry, seconds = ensure(recipe, workshop, manifest, rebuild=args.rebuild and name in asked)
                how = "kept" if seconds is None else f"made in {seconds:.0f}s"
                print(f"{name}  {manifest.absolute(entry)}  {human_bytes(entry.bytes)}  {shares(entry.types)}  "
                      f"({how})", flush=True)  # fmt: skip
        except (RuntimeError, OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    say(f"manifest: {manifest.path}")
    return 0


def ensure(
    recipe: Recipe, workshop: Workshop, manifest: Manifest, rebuild: bool = False
) -> tuple[Entry, float | None]:
    """The entry of ``recipe``'s file, made unless the manifest holds a current one (or
    ``rebuild``); with the seconds making it took, None when it was kept. The manifest is saved
    after each file made, so an interrupted run keeps what it finished."""
    key = recipe.key(workshop, manifest)
    kept = None if rebuild else manifest.current(recipe.name, key)
    if kept is not None:
        return kept, None
    target = os.path.join(manifest.cache, recipe.filename)
    partial = target + ".partial"
    _remove(partial)
    workshop.start_file()
    workshop.say(f"making {recipe.name}: {recipe.summary}")
    start = time.monotonic()
    recipe.make(workshop, manifest, partial)
    if not os.path.exists(partial):
        raise RuntimeError(f"making {recipe.name} left no {partial}")
    _remove(target)
    os.replace(partial, target)
    seconds = time.monotonic() - start
    entry = describe(recipe, manifest.cache, target)
    entry.key, entry.commands, entry.tools = key, workshop.commands, dict(workshop.tools)
    entry.seconds = round(seconds, 1)
    entry.made_at = datetime.now(UTC).isoformat(timespec="seconds")
    manifest.record(entry)
    manifest.save()
    return entry, seconds


def describe(recipe: Recipe, cache: str, path: str) -> Entry:
    """An entry for the made file (or directory) at ``path``: its size, checksum and tensor types
    (the key and commands are the caller's)."""
    rel = os.path.relpath(path, cache)
    if recipe.kind == "hf-dir":
        files = directory_files(path)
        return Entry(recipe.name, rel, sum(size for size, _ in files.values()), directory_sha256(files), {},
                     types=safetensors_type_bytes(path), files=files)  # fmt: skip
    return Entry(recipe.name, rel, os.path.getsize(path), sha256_file(path), {}, types=gguf_type_bytes(path))


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
