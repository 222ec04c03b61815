"""Where the model cache is, and the path of a made file by its name, for any command that uses one."""

from __future__ import annotations

import os

from pdserve.bench.models.manifest import Manifest
from pdserve.bench.models.recipes import RECIPES

DEFAULT_CACHE = os.path.join("~", ".cache", "pdserve", "models")
CACHE_ENV = "PDSERVE_MODELS_CACHE"  # the cache when no --cache is given (else DEFAULT_CACHE)


def cache_dir(arg: str | None = None) -> str:
    """``arg``, else ``$PDSERVE_MODELS_CACHE``, else ``~/.cache/pdserve/models``; absolute."""
    return os.path.abspath(os.path.expanduser(arg or os.environ.get(CACHE_ENV) or DEFAULT_CACHE))


def model_path(name: str, cache: str | None = None) -> str:
    """The path of the file (or HF directory) ``name`` made by ``pdserve bench models``.

    Raises ``KeyError`` for a name no recipe makes and ``FileNotFoundError``, saying which command
    makes it, when it is not in the cache (or no longer whole)."""
    if name not in RECIPES:
        raise KeyError(f"no model named {name!r}; `pdserve bench models` makes: {', '.join(RECIPES)}")
    root = cache_dir(cache)
    manifest = Manifest.load(root)
    entry = manifest.present(name)
    if entry is None:
        raise FileNotFoundError(
            f"{name} is not made under {root}: run `pdserve bench models --only {name}`"
            + (f" --cache {root}" if cache else "")
        )
    return manifest.absolute(entry)
