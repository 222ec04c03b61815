"""Make ``spm-bpe-tiny.gguf``: a Llama-2/Mistral-style SentencePiece vocabulary, tokenizer only.

Not run by ``make test`` (the file is committed). It trains a small SentencePiece BPE model with
Llama's trainer settings (byte fallback, digits split, a dummy prefix, no whitespace folding,
<unk> <s> </s> = 0 1 2) on ``tests/data/quality_text.txt`` and the text set, then writes the
GGUF metadata the way llama.cpp's converter does (``_create_vocab_sentencepiece``: pieces,
scores, token types normal/unknown/control/byte; ``tokenizer.ggml.model = "llama"``, pre
"default", Llama 2's add_bos_token true / add_eos_token false, ``add_space_prefix`` true)
under the SmolLM2 file's ``llama`` architecture numbers, with Mistral's chat template.

``sentencepiece`` is not a project dependency: install it in a throwaway venv and pass its
python::

    python3 -m venv /tmp/spvenv && /tmp/spvenv/bin/pip install sentencepiece==0.2.3
    PYTHONPATH=. .venv/bin/python tests/data/tokenizers/make_spm_gguf.py --sentencepiece-python /tmp/spvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
OUTPUT = os.path.join(HERE, "spm-bpe-tiny.gguf")
VOCAB_SIZE = 2000

# Mistral-7B-Instruct-v0.1's template: it writes the BOS text itself.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)

# Runs in the sentencepiece venv: train, then print [piece, score, llama.cpp token type] rows.
_TRAIN = r"""
import json, sys
import sentencepiece as spm
corpus, prefix, vocab_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=prefix, model_type="bpe", vocab_size=vocab_size,
    byte_fallback=True, split_digits=True, add_dummy_prefix=True, remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True, normalization_rule_name="identity", character_coverage=1.0,
    unk_id=0, bos_id=1, eos_id=2, pad_id=-1, hard_vocab_limit=False, num_threads=1,
    split_by_unicode_script=True, max_sentence_length=1 << 16, minloglevel=2,
)
sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
rows = []
for i in range(sp.vocab_size()):
    kind = 1  # NORMAL
    if sp.IsUnknown(i): kind = 2
    elif sp.IsControl(i): kind = 3
    elif sp.IsUnused(i): kind = 5
    elif sp.IsByte(i): kind = 6
    rows.append([sp.IdToPiece(i), sp.GetScore(i), kind])
json.dump(rows, sys.stdout, ensure_ascii=False)
"""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sentencepiece-python", required=True, help="a python with sentencepiece")
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    from pdserve.engine.model.loader import bundled_model_path
    from tests.helpers.gguf_tokenizer import gguf_metadata, load_texts, write_tokenizer_gguf

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(os.path.join(REPO, "tests", "data", "quality_text.txt"), encoding="utf-8") as f:
            lines = f.read().splitlines()
        for entry in load_texts():
            lines += entry["text"].splitlines()
        with open(corpus, "w", encoding="utf-8") as f:
            f.write("\n".join(line for line in lines if line.strip()) + "\n")
        out = subprocess.run(
            [args.sentencepiece_python, "-c", _TRAIN, corpus, os.path.join(tmp, "spm"), str(VOCAB_SIZE)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    rows = json.loads(out)
    arch = {k: v for k, v in gguf_metadata(bundled_model_path()).items() if k.startswith("llama.")}
    metadata = {
        "general.architecture": "llama",
        "general.name": "pdserve spm-bpe-tiny (tokenizer only)",
        **arch,
        "llama.vocab_size": len(rows),
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [r[0] for r in rows],
        "tokenizer.ggml.scores": [float(r[1]) for r in rows],
        "tokenizer.ggml.token_type": [int(r[2]) for r in rows],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": True,
        "tokenizer.chat_template": MISTRAL_TEMPLATE,
    }
    write_tokenizer_gguf(OUTPUT, metadata)
    print(f"{OUTPUT}: {len(rows)} tokens, {os.path.getsize(OUTPUT)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
