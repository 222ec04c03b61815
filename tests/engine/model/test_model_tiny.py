"""The Llama model over the paged KV cache, on the tiny random checkpoint (fast).

Self-consistency tests (chunked prefill, decode, mixed batches, bf16) run in milliseconds; the
comparisons with transformers (Llama and Qwen2 variants) are marked slow.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.hf_loader import load_hf_dir
from pdserve.engine.model.llama import LlamaForCausalLM
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.tiny import write_tiny_model
from pdserve.engine.model.weights import build_model, hf_to_model_state_dict, model_to_hf_state_dict
from tests.helpers.model_steps import BLOCK_SIZE, assert_logits_close, attn_batch, prefill_logits, run_step

PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog sleeps in the warm sun all day."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def prompt_ids(tiny) -> list[int]:
    ids = tiny.tokenizer.encode(PROMPT)
    assert len(ids) > 40
    return ids[:40]


def _digest(directory: str) -> str:
    with open(os.path.join(directory, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    a = write_tiny_model(str(tmp_path / "a"), seed=0)
    b = write_tiny_model(str(tmp_path / "b"), seed=0)
    c = write_tiny_model(str(tmp_path / "c"), seed=1)
    assert _digest(a) == _digest(b) != _digest(c)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.exists(os.path.join(a, name))


def test_load_model_reads_tiny_dir(tiny, tiny_dir):
    arch = tiny.arch
    assert (arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (64, 4, 2, 16)
    assert arch.vocab_size == tiny.tokenizer.vocab_size
    assert not arch.tie_word_embeddings and tiny.model.lm_head is not None
    assert tiny.path == os.path.abspath(tiny_dir)
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert tiny.tokenizer.eos_token_id == 2 and tiny.tokenizer.eos_token == "<|im_end|>"


def test_tiny_tokenizer_round_trips_text_and_chat(tiny):
    tok = tiny.tokenizer
    for text in [PROMPT, "naïve café 日本語 🎉", "def f(x):\n    return x  # ok\n", ""]:
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert ids[0] == tok.token_to_id("<|im_start|>")  # specials stay whole
    assert tok.decode(ids) == "user\nhi\nassistant\n"  # and are skipped on decode


def test_state_dict_conversion_round_trips(tiny_dir):
    arch, state = load_hf_dir(tiny_dir)
    hf_state = model_to_hf_state_dict(state, arch)
    assert "model.layers.0.self_attn.q_proj.weight" in hf_state
    assert "model.layers.0.mlp.up_proj.weight" in hf_state
    back = hf_to_model_state_dict(hf_state, arch)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_kv_cache_spec_matches_model(tiny):
    spec = tiny.arch.kv_cache_spec(BLOCK_SIZE, "bfloat16")
    assert spec.block_shape == (2, 2, BLOCK_SIZE, 2, 16)
    assert spec.torch_dtype == torch.bfloat16


def test_decode_after_prefill_equals_longer_prefill(tiny, prompt_ids):
    full = prefill_logits(tiny.model, tiny.arch, prompt_ids)
    kv = tiny.arch.kv_cache_spec(BLOCK_SIZE).allocate(4)
    head = prompt_ids[:-2]
    meta, pos = attn_batch(prefills=[([0, 1, 2], 0, len(head))])
    logits = run_step(tiny.model, kv, head, meta, pos)
    torch.testing.assert_close(logits, full[: len(head)], atol=1e-5, rtol=1e-5)
    for n in (len(prompt_ids) - 1, len(prompt_ids)):  # two decode steps through the cache
        meta, pos = attn_batch(decodes=[([0, 1, 2], n)])
        step = run_step(tiny.model, kv, [prompt_ids[n - 1]], meta, pos)
        torch.testing.assert_close(step[0], full[n - 1], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_one_prefill(tiny, prompt_ids):
    full = prefill_logits(tiny.model, tiny.arch, prompt_ids)
    kv = tiny.arch.kv_cache_spec(BLOCK_SIZE).allocate(8)
    table = [5, 2, 7]  # scattered blocks: positions must follow the table, not the block ids
    cut = 19  # not on a block boundary
    meta, pos = attn_batch(prefills=[(table, 0, cut)])
    first = run_step(tiny.model, kv, prompt_ids[:cut], meta, pos)
    meta, pos = attn_batch(prefills=[(table, cut, len(prompt_ids) - cut)])
    second = run_step(tiny.model, kv, prompt_ids[cut:], meta, pos)
    torch.testing.assert_close(torch.cat([first, second]), full, atol=1e-5, rtol=1e-5)


def test_mixed_batch_equals_sequences_run_alone(tiny, prompt_ids):
    """Two decodes and two prefill chunks in one flattened step, each as if run alone."""
    a, b = prompt_ids[:23], prompt_ids[7:37]
    ref_a = prefill_logits(tiny.model, tiny.arch, a)
    ref_b = prefill_logits(tiny.model, tiny.arch, b)
    kv = tiny.arch.kv_cache_spec(BLOCK_SIZE).allocate(16)
    tables = {"a": [0, 1], "b": [2, 3], "c": [4, 5], "d": [6, 7]}
    # Warm caches: a and b hold all but their last token; c and d get chunks this step.
    for name, ids in (("a", a[:-1]), ("b", b[:-1])):
        meta, pos = attn_batch(prefills=[(tables[name], 0, len(ids))])
        run_step(tiny.model, kv, ids, meta, pos)
    meta, pos = attn_batch(prefills=[(tables["d"], 0, 10)])
    run_step(tiny.model, kv, b[:10], meta, pos)
    meta, pos = attn_batch(
        decodes=[(tables["a"], len(a)), (tables["b"], len(b))],
        prefills=[(tables["c"], 0, len(a)), (tables["d"], 10, len(b) - 10)],
    )
    ids = [a[-1], b[-1], *a, *b[10:]]
    logits = run_step(tiny.model, kv, ids, meta, pos)
    torch.testing.assert_close(logits[0], ref_a[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], ref_b[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[2 : 2 + len(a)], ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[2 + len(a) :], ref_b[10:], atol=1e-5, rtol=1e-5)


def test_bfloat16_model_tracks_float32(tiny_dir, tiny, prompt_ids):
    bf16 = load_model(tiny_dir, dtype="bfloat16")
    assert bf16.model.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = prefill_logits(tiny.model, tiny.arch, prompt_ids)
    logits = prefill_logits(bf16.model, bf16.arch, prompt_ids)
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_random_init_model_runs_without_loader():
    """``LlamaForCausalLM(config)`` alone is a usable module (tied embeddings, q/k/v bias)."""
    arch = ModelArchConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=1,
        head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
        tie_word_embeddings=True, attention_bias=True,
    )  # fmt: skip
    model = LlamaForCausalLM(arch).eval()
    assert "lm_head.weight" not in model.state_dict()
    assert model.state_dict()["model.layers.0.self_attn.qkv_proj.bias"].shape == (48,)
    rebuilt = build_model(arch, model.state_dict())
    torch.testing.assert_close(
        prefill_logits(rebuilt, arch, list(range(20))), prefill_logits(model, arch, list(range(20)))
    )


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["llama", "qwen2", "llama3-rope"])
def test_tiny_logits_match_transformers(tmp_path, variant):
    from transformers import AutoModelForCausalLM

    directory = write_tiny_model(str(tmp_path), seed=3, attention_bias=variant == "qwen2")
    if variant == "llama3-rope":  # long wavelengths slowed down, as Llama 3.1 does
        path = os.path.join(directory, "config.json")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f)
    ours = load_model(directory)
    assert (ours.arch.rope_scaling is not None) == (variant == "llama3-rope")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    assert type(hf).__name__ == ("Qwen2ForCausalLM" if variant == "qwen2" else "LlamaForCausalLM")
    ids = ours.tokenizer.encode(PROMPT * 3)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    assert_logits_close(prefill_logits(ours.model, ours.arch, ids), expected, rel=1e-5)


def test_load_model_rejects_missing_path_and_unknown_arch(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing"))
    with open(os.path.join(tiny_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    with pytest.raises(ValueError, match="model_type"):
        ModelArchConfig.from_hf_config({**cfg, "model_type": "gpt2"})


def test_hf_config_rope_forms_agree(tiny_dir):
    """transformers 4.x ``rope_theta`` + ``rope_scaling`` and 5.x ``rope_parameters`` read alike."""
    with open(os.path.join(tiny_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}  # fmt: skip
    old = {**cfg, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    new = {k: v for k, v in cfg.items() if k != "rope_theta"}
    new["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}
    assert ModelArchConfig.from_hf_config(old) == ModelArchConfig.from_hf_config(new)
    arch = ModelArchConfig.from_hf_config(new)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling["rope_type"] == "llama3"
    plain = ModelArchConfig.from_hf_config(
        {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}
    )
    assert plain.rope_scaling is None
