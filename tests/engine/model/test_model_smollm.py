"""The bundled SmolLM2-135M GGUF: pdserve's weights and logits against transformers' (fp32).

transformers dequantises the same file with the same ``gguf`` routine and undoes llama.cpp's
q/k permutation itself, so the weights must be *equal*, and logits equal to float32 noise.
Each model is loaded once for the module.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from pdserve.engine.model.gguf_file import GGUFFile
from pdserve.engine.model.gguf_loader import open_gguf, read_arch_config, unpermute_qk
from pdserve.engine.model.loader import bundled_model_path, load_model
from pdserve.engine.model.weights import model_to_hf_state_dict
from tests.helpers.model_steps import BLOCK_SIZE, assert_logits_close, attn_batch, prefill_logits, run_step

pytestmark = pytest.mark.slow

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Books became cheaper, "
    "literacy spread across Europe, and scientists could share their results."
)
PROMPT_LEN = 40


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (HF rows -> GGUF rows)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.fixture(scope="module")
def reader() -> GGUFFile:
    return open_gguf(bundled_model_path())


@pytest.fixture(scope="module")
def ours():
    return load_model(None, dtype="float32")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = bundled_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def ids(ours) -> list[int]:
    ids = ours.tokenizer.encode(TEXT)
    assert len(ids) > PROMPT_LEN + 1
    return ids[: PROMPT_LEN + 1]


@pytest.fixture(scope="module")
def hf_logits(hf_model, ids) -> torch.Tensor:
    """transformers' logits for prompt + one more token: rows [:PROMPT_LEN] are the prefill's,
    row PROMPT_LEN the decode step's."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for rows, n_head in ((576, 9), (192, 3), (64, 1)):
        w = rng.standard_normal((rows, 5)).astype(np.float32)
        assert np.array_equal(unpermute_qk(llama_cpp_permute(w, n_head), n_head), w)
        assert not np.array_equal(llama_cpp_permute(w, n_head), w)
    bias = rng.standard_normal(192).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(bias, 3), 3), bias)


def test_arch_config_matches_transformers(ours, hf_model, reader):
    cfg, arch = hf_model.config, ours.arch
    assert arch == read_arch_config(reader)
    assert arch.num_layers == cfg.num_hidden_layers == 30
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )
    assert (arch.hidden_size, arch.intermediate_size, arch.vocab_size) == (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    assert arch.rope_theta == cfg.rope_parameters["rope_theta"] == 100000.0
    assert arch.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
    assert arch.tie_word_embeddings and cfg.tie_word_embeddings
    assert (arch.bos_token_id, arch.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)


def test_every_gguf_weight_equals_transformers(ours, hf_model, reader):
    expected = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # tied
    actual = model_to_hf_state_dict(ours.model.state_dict(), ours.arch)
    assert actual.keys() == expected.keys()
    mismatched = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not mismatched, f"{len(mismatched)} tensors differ, e.g. {mismatched[:3]}"
    # Equality must not be vacuous: q/k really were permuted in the file.
    q_from_file = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = torch.from_numpy(gguf.quants.dequantize(q_from_file.data, q_from_file.tensor_type).copy())
    assert not torch.equal(raw, expected["model.layers.0.self_attn.q_proj.weight"])


def test_prefill_logits_match_transformers(ours, ids, hf_logits):
    logits = prefill_logits(ours.model, ours.arch, ids[:PROMPT_LEN])
    assert_logits_close(logits, hf_logits[:PROMPT_LEN])


def test_decode_step_from_cache_matches_transformers(ours, ids, hf_logits):
    kv = ours.arch.kv_cache_spec(BLOCK_SIZE).allocate(3)
    table = [0, 1, 2]
    meta, pos = attn_batch(prefills=[(table, 0, PROMPT_LEN)])
    prefill = run_step(ours.model, kv, ids[:PROMPT_LEN], meta, pos)
    assert_logits_close(prefill, hf_logits[:PROMPT_LEN])
    meta, pos = attn_batch(decodes=[(table, PROMPT_LEN + 1)])
    assert meta.num_decode_tokens == 1
    step = run_step(ours.model, kv, [ids[PROMPT_LEN]], meta, pos)
    assert_logits_close(step, hf_logits[PROMPT_LEN:])


def test_chunked_prefill_matches_transformers(ours, ids, hf_logits):
    kv = ours.arch.kv_cache_spec(BLOCK_SIZE).allocate(3)
    table, cut = [2, 0, 1], 21
    meta, pos = attn_batch(prefills=[(table, 0, cut)])
    first = run_step(ours.model, kv, ids[:cut], meta, pos)
    meta, pos = attn_batch(prefills=[(table, cut, PROMPT_LEN - cut)])
    second = run_step(ours.model, kv, ids[cut:PROMPT_LEN], meta, pos)
    assert_logits_close(first, hf_logits[:cut])
    assert_logits_close(second, hf_logits[cut:PROMPT_LEN])
