"""``pdserve bench step`` end to end on the tiny model: the floor is the weights the step reads
over the bandwidth measured in the same run, the JSON and the plot are written.

Structure and arithmetic only; no timing thresholds.
"""

from __future__ import annotations

import json

import torch

from pdserve.bench import step
from pdserve.engine.model.loader import load_model


def test_bench_step_reports_the_step_against_the_weights_floor(tiny_model_dir, tmp_path):
    out_json, out_png = tmp_path / "step.json", tmp_path / "step.png"
    threads = torch.get_num_threads()
    try:
        code = step.main(
            ["--model", tiny_model_dir, "--dtypes", "float32", "bfloat16", "--quantizations", "none", "int8",
             "--batch-sizes", "1", "3",
             "--context", "24", "--decode-tokens", "4", "--repeats", "1",
             "--json", str(out_json), "--plot", str(out_png)]
        )  # fmt: skip
        assert torch.get_num_threads() == 1  # --threads 1, the default: one engine's core
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    payload = json.loads(out_json.read_text())
    assert out_png.stat().st_size > 0
    rows = payload["rows"]
    assert [(r["quantization"], r["dtype"], r["batch"]) for r in rows] == [
        (quantization, dtype, batch)
        for quantization in ("none", "int8")
        for dtype in ("float32", "bfloat16")
        for batch in (1, 3)
    ]
    model = load_model(tiny_model_dir, dtype="float32").model
    # fp32: every parameter of the layers, the final norm and the (tied) head, 4 bytes each;
    # bf16 reads half of that, packed for oneDNN or not.
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    head = model.model.embed_tokens.weight.numel()
    fp32_bytes = 4 * (layer_params + model.model.norm.weight.numel() + head)
    by_config = {(r["quantization"], r["dtype"]): r for r in rows}
    assert by_config["none", "float32"]["weight_mb"] * 1e6 == fp32_bytes
    assert by_config["none", "bfloat16"]["weight_mb"] * 1e6 == fp32_bytes / 2
    # int8: projections and head as Q8_0 (34 bytes a 32 weights), the norms still in the dtype.
    layer_norms = sum(m.weight.numel() for n, m in model.model.layers.named_modules() if n.endswith("norm"))
    norm_params = layer_norms + model.model.norm.weight.numel()
    q8_bytes = (layer_params - layer_norms + head) * 34 // 32
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
        assert by_config["int8", dtype]["weight_mb"] * 1e6 == q8_bytes + norm_params * itemsize
    for row in rows:
        assert row["bandwidth_gbs"] > 0 and row["step_ms"] > 0
        floor_ms = row["weight_mb"] * 1e6 / (row["bandwidth_gbs"] * 1e9) * 1e3
        assert abs(row["floor_ms"] - floor_ms) < 1e-9 * floor_ms + 1e-12
        assert abs(row["step_over_floor"] - row["step_ms"] / row["floor_ms"]) < 1e-9 * row["step_over_floor"]
        assert abs(row["step_ms"] - row["matmuls_ms"] - row["attention_ms"] - row["other_ms"]) < 1e-6
        assert abs(row["tok_s"] - row["batch"] / (row["step_ms"] / 1e3)) < 1e-6 * row["tok_s"]
