"""``--quantization`` through the loader, ``pdserve.LLM`` and real engine processes.

- The bundled GGUF in ``gguf`` mode holds the file's own bytes: its weights take within 5% of
  the file's tensor bytes, and its prefill logits in fp32 are the dense fp32 model's exactly
  (the same numbers: Q4_1 and Q8_0 blocks are kept as they are).
- ``int8`` works from any checkpoint (the tiny HF one here), and a prefill engine holding int8
  blocks hands its KV to a decode engine holding dense weights: the KV layout does not depend
  on the weights, and each side reports what it runs.
- Bad settings fail before anything loads, with a message naming the problem.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.engine.core_client import EngineCoreClient
from pdserve.engine.model.gguf_file import GGUFFile
from pdserve.engine.model.layers.quant_linear import QuantEmbedding, QuantLinear
from pdserve.engine.model.loader import bundled_model_path, load_model
from pdserve.engine.request import SamplingParams
from pdserve.kernels.cpu import quant as cpu_quant
from tests.helpers.model_steps import prefill_logits
from tests.helpers.pd import engine_config, pd_generate, wait_idle

pytestmark = pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler to build the kernels")


def file_tensor_bytes(path: str) -> int:
    return sum(t.n_bytes for t in GGUFFile(path).tensors)


@pytest.mark.slow
def test_gguf_mode_serves_the_files_own_blocks():
    path = bundled_model_path()
    quantized = load_model(path, dtype="float32", quantization="gguf")
    model = quantized.model
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert all(isinstance(m, QuantLinear) for m in model.model.layers[0].mlp.children())
    assert "Q4_1" in quantized.weights and "Q8_0" in quantized.weights
    # Goal: within 5% of the file (96.6 MB for the bundled one); fp32 dense takes 538 MB.
    file_bytes = file_tensor_bytes(path)
    assert abs(quantized.weight_bytes / file_bytes - 1) < 0.05, (quantized.weight_bytes, file_bytes)

    dense = load_model(path, dtype="float32")
    assert dense.weight_bytes > 5 * quantized.weight_bytes
    prompt = dense.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    # A prefill of more than KERNEL_MAX_ROWS rows decodes the blocks and runs the dense GEMM:
    # the same weights, so the same logits, bit for bit. The dense model holds its projections
    # [in, out] in memory (``use_kn_weight_layout``), the decoded blocks are [out, in]: MKL's two
    # GEMMs may round differently (they do on an AVX-512 Xeon: down_proj at 17-39 rows), so the
    # reference here runs on [out, in] copies of its weights, the GEMM the blocks' path calls.
    long_prompt = prompt * 3
    for module in dense.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.detach().contiguous(), requires_grad=False)
    assert torch.equal(
        prefill_logits(model, quantized.arch, long_prompt),
        prefill_logits(dense.model, dense.arch, long_prompt),
    )
    # Short ones go through the C kernel: the same up to fp32 summation order.
    torch.testing.assert_close(
        prefill_logits(model, quantized.arch, prompt[:5]),
        prefill_logits(dense.model, dense.arch, prompt[:5]),
        rtol=1e-4,
        atol=1e-4,
    )


def test_int8_from_an_hf_checkpoint_tracks_the_dense_model(tiny_model_dir):
    dense = load_model(tiny_model_dir, dtype="float32")
    int8 = load_model(tiny_model_dir, dtype="float32", quantization="int8")
    assert int8.weights.startswith("Q8_0") and int8.quantization == "int8"
    # Q8_0: 34 bytes a 32 weights, against fp32's 128.
    assert int8.weight_bytes < 0.3 * dense.weight_bytes
    prompt = list(range(3, 40))
    expected = prefill_logits(dense.model, dense.arch, prompt)
    got = prefill_logits(int8.model, int8.arch, prompt)
    # int8 steps are 1/127 of each 32's largest weight: logits move by a few 1e-2 on a std ~2
    # scale (measured max 0.05), so greedy picks differ only at near-ties (2 of 37 positions).
    assert (got - expected).abs().max() < 0.1
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_int8_activations_hold_the_same_weights_and_change_only_the_kernels_rows(tiny_model_dir):
    """``int8-a8``: the int8 mode's blocks, with x quantized to int8 in the kernel: decode rows
    (up to KERNEL_MAX_ROWS) everywhere, and prefill chunks too where the weights are interleaved
    (AVX512-VNNI); elsewhere longer prefill chunks decode the blocks for the same GEMM as int8."""
    int8 = load_model(tiny_model_dir, dtype="float32", quantization="int8")
    a8 = load_model(tiny_model_dir, dtype="float32", quantization="int8-a8")
    assert a8.quantization == "int8-a8" and "int8 activations" in a8.weights
    assert "int8 activations" not in int8.weights and a8.weight_bytes == int8.weight_bytes
    prompt = list(range(3, 40))
    long_got, long_exact = (
        prefill_logits(a8.model, a8.arch, prompt),
        prefill_logits(int8.model, int8.arch, prompt),
    )
    if cpu_quant.x16_route():
        assert not torch.equal(long_got, long_exact)  # the prefill's x was rounded to int8 too
        assert (long_got - long_exact).abs().max() < 0.1
    else:
        assert torch.equal(long_got, long_exact)
    got, exact = (
        prefill_logits(a8.model, a8.arch, prompt[:5]),
        prefill_logits(int8.model, int8.arch, prompt[:5]),
    )
    assert not torch.equal(got, exact)  # x was rounded to int8 ...
    assert (got - exact).abs().max() < 0.1  # ... by 1/254 of each 32's largest value at most


def test_bad_quantization_settings_fail_up_front(tiny_model_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="q4")
    with pytest.raises(ValueError, match=r"needs a \.gguf"):
        load_model(tiny_model_dir, quantization="gguf")  # an HF directory has no GGUF blocks
    with pytest.raises(ValueError, match=r"needs a \.gguf"):
        ModelConfig(path="/models/model.safetensors", quantization="gguf")
    with pytest.raises(ValueError, match=r"'gguf-a8' needs a \.gguf"):
        ModelConfig(path="/models/model.safetensors", quantization="gguf-a8")
    with pytest.raises(ValueError, match=r"needs a \.gguf"):
        load_model(tiny_model_dir, quantization="gguf-a8")


def test_prefill_with_int8_weights_hands_kv_to_a_dense_decode_engine(tiny_model_dir, tiny_llm):
    """KV is the same layout whatever the weights: prefill (int8) and decode (dense fp32) still
    exchange it, and each reports what its weights are."""
    prompt = list(range(5, 60))
    prefill_config = engine_config(tiny_model_dir, "producer", "tcp")
    prefill_config = dataclasses.replace(
        prefill_config, model=ModelConfig(path=tiny_model_dir, quantization="int8")
    )
    prefill = EngineCoreClient(prefill_config)
    try:
        decode = EngineCoreClient(engine_config(tiny_model_dir, "consumer", "tcp"))
        try:
            assert prefill.info is not None and decode.info is not None
            assert prefill.info.quantization == "int8" and prefill.info.weights.startswith("Q8_0")
            assert decode.info.quantization == "none" and "Q8_0" not in decode.info.weights
            assert prefill.info.weight_bytes < decode.info.weight_bytes / 3
            first, rest = pd_generate(prefill, decode, "mixed-0", prompt, max_tokens=6)
            assert rest.finish_reason == "length" and len(rest.new_token_ids) == 5
            decode_stats = wait_idle(decode)
            prefill_stats = wait_idle(prefill)
        finally:
            decode.close()
    finally:
        prefill.close()
    # The KV was pulled, not recomputed, and both engines are back to zero blocks.
    assert decode_stats["kv_connector"]["num_loads_ok"] == 1
    assert decode_stats["kv_connector"]["num_blocks_pulled"] >= len(prompt) // 16
    assert decode_stats["kv_cache_usage"] == 0.0 and prefill_stats["num_held_blocks"] == 0
    # The first token is the int8 model's; with a dense decode the rest follow the dense model
    # on the int8 KV, close enough on the tiny model to give the dense model's greedy tokens.
    expected = tiny_llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    assert first.new_token_ids + rest.new_token_ids == expected


@pytest.mark.slow
def test_cluster_serves_int8_weights_and_reports_them(tiny_model_dir):
    """``--quantization int8`` on every engine of a real cluster: the router's greedy tokens are
    the colocated int8 model's, Info and ``/metrics`` report the weights, and each side of the
    KV handshake logs what the other's weights are."""
    import urllib.request

    import grpc

    from pdserve import LLM
    from pdserve.client import Client
    from pdserve.cluster import LocalCluster
    from pdserve.v1 import engine_pb2, engine_pb2_grpc
    from tests.helpers.cluster import TINY_ENGINE_ARGS

    prompt = list(range(7, 70))
    colocated = LLM(tiny_model_dir, dtype="float32", quantization="int8", max_model_len=1024, num_blocks=64)
    expected = colocated.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    args = [*TINY_ENGINE_ARGS, "--quantization", "int8"]
    with LocalCluster(1, 1, model=tiny_model_dir, kv_transport="tcp", engine_args=args) as cluster:
        with Client(cluster.router_address) as client:
            got = client.generate(prompt_token_ids=prompt, max_tokens=8, ignore_eos=True, timeout=60)
        assert got.metrics["prefill_engine"], "the request went through the prefill engine"
        assert list(got.token_ids) == expected
        for name in ("prefill-0", "decode-0"):
            proc = cluster.procs[name]
            with grpc.insecure_channel(proc.address) as channel:
                info = engine_pb2_grpc.EngineStub(channel).Info(engine_pb2.InfoRequest(), timeout=10)
            assert info.quantization == "int8" and info.weights.startswith("Q8_0"), info
            assert 0 < info.weight_bytes < 200_000, info  # tiny: 99 KB as Q8_0, 444 KB in fp32
            with urllib.request.urlopen(f"http://{proc.metrics_address}/metrics", timeout=10) as response:
                metrics = response.read().decode()
            assert "pdserve_engine_weight_bytes{" in metrics
            line = next(x for x in metrics.splitlines() if x.startswith("pdserve_engine_weight_bytes{"))
            assert float(line.rsplit(" ", 1)[1]) == info.weight_bytes
        decode_log = Path(cluster.procs["decode-0"].log_path).read_text(encoding="utf-8")
        assert "its weights Q8_0" in decode_log and "ours Q8_0" in decode_log, decode_log[-2000:]


def test_auto_serves_a_gguf_files_blocks_where_the_kernels_build(tiny_model_dir, monkeypatch):
    """The default: a GGUF file's own blocks (the same numbers as its dense copy, fewer bytes a
    step) on every engine, prefill ones too, so that a P/D cluster gives a colocated engine's
    tokens; dense for an HF checkpoint and where the kernels cannot build."""
    from pdserve.engine.model.loader import resolve_quantization

    monkeypatch.delenv("PDSERVE_QUANTIZATION", raising=False)
    assert ModelConfig().quantization == "auto"
    gguf_path = bundled_model_path()
    # Int8 activations where the CPU has VNNI (chosen by measurement: see resolve_quantization).
    for vnni, want in ((True, "gguf-a8"), (False, "gguf")):
        monkeypatch.setattr(cpu_quant, "int8_dot_route", lambda vnni=vnni: vnni)
        assert resolve_quantization("auto", gguf_path) == want
        assert resolve_quantization("auto", None) == want  # None: the bundled GGUF
        assert resolve_quantization("auto", gguf_path, "consumer") == want
        assert resolve_quantization("auto", gguf_path, "producer") == want
        assert resolve_quantization("auto", tiny_model_dir) == "none"
    for explicit in ("none", "gguf", "int8"):
        assert resolve_quantization(explicit, gguf_path, "producer") == explicit
    monkeypatch.setattr(cpu_quant, "available", lambda: False)
    assert resolve_quantization("auto", gguf_path) == "none"
    with pytest.raises(ValueError, match="auto"):
        load_model(tiny_model_dir, quantization="auto")  # resolved before loading, never passed on
