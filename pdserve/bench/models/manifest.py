"""The model cache's manifest: what was made, from what, by which commands, and its checksums.

One JSON file (``manifest.json``) at the top of the cache. A file is made again only when its
entry is gone, its file (or one file of its directory) is missing or of another size, or its
``key`` (what determines its bytes: the tool spec, the inputs' checksums, the recipe) differs from
the one a run asks for; otherwise it is kept as it is. Sizes are checked on every run, checksums
only when the file is made (hashing the 1B model's directory takes seconds; a truncated or
half-copied file has another size).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT = 1  # of the manifest file; another format reads as an empty manifest (everything remade)


@dataclass
class Entry:
    """One made file or directory. ``path`` is relative to the cache, so a cache can be moved."""

    name: str
    path: str
    bytes: int
    sha256: str  # of the file; of a directory, of its sorted "relpath sha256" lines
    key: dict[str, Any]  # what determines the bytes: remade when a run asks for another key
    commands: list[list[str]] = field(default_factory=list)  # in the order they ran
    # The versions of the tools that ran. Not part of the key: a key must be known before the
    # tools are built, so a run that keeps every file never builds llama.cpp.
    tools: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    made_at: str = ""
    types: dict[str, int] = field(default_factory=dict)  # tensor bytes by GGUF type (or dtype)
    files: dict[str, list[Any]] = field(default_factory=dict)  # a directory's {relpath: [bytes, sha256]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})


class Manifest:
    """The entries of one cache, ``{name: Entry}``; ``save`` replaces the file atomically, so a run
    killed halfway leaves the previous manifest, never half of one."""

    def __init__(self, cache: str, entries: dict[str, Entry] | None = None) -> None:
        self.cache = cache
        self.entries = entries or {}

    @property
    def path(self) -> str:
        return os.path.join(self.cache, MANIFEST_NAME)

    @classmethod
    def load(cls, cache: str) -> Manifest:
        path = os.path.join(cache, MANIFEST_NAME)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return cls(cache)
        if data.get("format") != FORMAT:
            return cls(cache)
        return cls(cache, {name: Entry.from_json(entry) for name, entry in data.get("models", {}).items()})

    def save(self) -> None:
        os.makedirs(self.cache, exist_ok=True)
        partial = self.path + ".partial"
        models = {name: asdict(entry) for name, entry in sorted(self.entries.items())}
        with open(partial, "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "models": models}, f, indent=2)
            f.write("\n")
        os.replace(partial, self.path)

    def absolute(self, entry: Entry) -> str:
        return os.path.join(self.cache, entry.path)

    def present(self, name: str) -> Entry | None:
        """The entry of ``name`` if its file (or every file of its directory) is there with the
        recorded size."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        path = self.absolute(entry)
        if entry.files:
            sizes = ((os.path.join(path, rel), size) for rel, (size, _) in entry.files.items())
            intact = all(os.path.isfile(p) and os.path.getsize(p) == size for p, size in sizes)
        else:
            intact = os.path.isfile(path) and os.path.getsize(path) == entry.bytes
        return entry if intact else None

    def current(self, name: str, key: dict[str, Any]) -> Entry | None:
        """The entry of ``name`` if it is present and was made with ``key``: the one to keep."""
        entry = self.present(name)
        return entry if entry is not None and entry.key == _normalized(key) else None

    def record(self, entry: Entry) -> None:
        entry.key = _normalized(entry.key)
        self.entries[entry.name] = entry


def _normalized(key: dict[str, Any]) -> dict[str, Any]:
    """``key`` as it reads back from JSON (tuples become lists), so a key compares equal to the
    one recorded for it."""
    return json.loads(json.dumps(key, sort_keys=True))


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def directory_files(path: str) -> dict[str, list[Any]]:
    """``{relpath: [bytes, sha256]}`` of every file under ``path``, sorted by relpath."""
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            found[os.path.relpath(full, path)] = [os.path.getsize(full), sha256_file(full)]
    return dict(sorted(found.items()))


def directory_sha256(files: dict[str, list[Any]]) -> str:
    """One checksum of a directory: of its sorted ``relpath sha256`` lines."""
    lines = "".join(f"{rel} {sha}\n" for rel, (_, sha) in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()
