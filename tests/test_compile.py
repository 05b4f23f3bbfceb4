"""`kiln compile` for TPU targets without a TPU (libtpu's deviceless topologies), and its user errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from tiny_models import COMMON, make_model
from tiny_tokenizer import write_tokenizer

from kiln.compile import artifact
from kiln.models.errors import KilnError
from kiln.serving.cli import main
from kiln.targets.target import BUILTIN

SMALL = ["--buckets", "8", "--max-num-seqs", "4", "--kv-tokens", "256", "--max-model-len", "64"]
# pallas_tpu compiles with Mosaic for head_dim 64 and 32-page block-table rows (head_dim 16 or 4-page rows do not)
TPU = ["--buckets", "8", "--max-num-seqs", "4", "--kv-tokens", "512", "--max-model-len", "512"]


def tpu_model(folder: Path, heads: int, kv_heads: int, hidden: int = COMMON["hidden_size"]) -> Path:
    shape = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": 64, "hidden_size": hidden}
    config = transformers.LlamaConfig(**{**COMMON, **shape})
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_llama")
    make_model("llama", folder)  # 4 heads, 2 KV heads
    write_tokenizer(folder)
    return folder


def compile_cli(*argv: str) -> int:
    return main(["compile", *argv])


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kiln: error:")]
    assert len(err) == 1, err
    return err[0]


def assert_tpu_artifact(path: Path, kind: str, count: int, tp: int) -> dict:
    m = json.loads((path / "manifest.json").read_text())
    assert m["runtime"]["platform"] == "tpu" and m["runtime"]["device_kind"] == kind
    assert m["runtime"]["device_count"] == count and m["runtime"]["libtpu"]
    assert m["mesh"]["shape"] == [tp] and m["geometry"]["kv_dtype"] == "bfloat16"
    for name in m["programs"]:
        assert (path / "programs" / f"{name}.exported").stat().st_size > 0
        assert (path / "programs" / f"{name}.tpu").stat().st_size > 0
        assert m["files"][f"programs/{name}.tpu"] == artifact.sha256(path / "programs" / f"{name}.tpu")
    return m


def test_tpu_v5e_1_deviceless(tmp_path, capsys):
    model = tpu_model(tmp_path / "tiny", 6, 3, hidden=96)  # 3 KV heads of 64, as SmolLM2
    out = tmp_path / "tiny.tpu-v5e-1"
    kv = ["--kv-tokens", "131072"]  # a cache large enough that a copy of it would dominate the temporaries
    buckets = ["--buckets", "4,8"]  # 4 <= max_num_seqs: also a multi-step decode program (the target's 8 steps)
    assert compile_cli("--model", str(model), "--target", "tpu-v5e-1", "--out", str(out), *TPU, *kv, *buckets) == 0
    assert str(out) in capsys.readouterr().out
    m = assert_tpu_artifact(out, "TPU v5 lite", 1, 1)
    assert m["target"]["attention"] == "pallas_tpu"
    assert sorted(m["programs"]) == ["decode_t4", "gather_t4", "init_kv", "step_t4", "step_t8"]
    # The KV pages are updated in place: each step program, and the decode program's loop, aliases the whole cache
    # and copies none of it (XLA-TPU's own layout for a head_dim-64 cache made it copy every layer's K and V twice a
    # step, 1.5x the cache in temps).
    kv = m["programs"]["init_kv"]["memory"]["output_size_in_bytes"]
    for name in ("step_t8", "step_t4", "decode_t4"):
        step = m["programs"][name]["memory"]
        assert step["alias_size_in_bytes"] >= kv - 1024 and step["temp_size_in_bytes"] < kv / 2, (name, kv, step)
    with pytest.raises(KilnError, match=r"is for target tpu-v5e-1 \(tpu\) but this machine runs cpu"):
        artifact.load(out)  # this machine has no TPU: one sentence, not a traceback


def test_tpu_v5e_8_tp8_deviceless(tmp_path):
    folder = tpu_model(tmp_path / "tiny8", 8, 8)
    out = tmp_path / "tiny8.tpu-v5e-8"
    assert compile_cli("--model", str(folder), "--target", "tpu-v5e-8", "--tp", "8", "--out", str(out), *TPU) == 0
    assert_tpu_artifact(out, "TPU v5 lite", 8, 8)


def test_unknown_target_lists_the_targets(model, capsys):
    assert compile_cli("--model", str(model), "--target", "tpu-v9") == 1
    line = one_error_line(capsys)
    assert "Unknown target 'tpu-v9'" in line and all(name in line for name in [*BUILTIN, "auto"])


def test_tp_must_divide_kv_heads(model, capsys):
    assert compile_cli("--model", str(model), "--target", "cpu", "--tp", "3", *SMALL) == 1
    assert "--tp 3 does not divide the model's 2 KV heads" in one_error_line(capsys)


def test_unreadable_models(tmp_path, capsys):
    assert compile_cli("--model", str(tmp_path / "missing"), "--target", "cpu") == 1
    assert "does not exist" in one_error_line(capsys)
    broken = tmp_path / "broken"
    make_model("qwen2", broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 100)
    assert compile_cli("--model", str(broken), "--target", "cpu", *SMALL) == 1
    assert "not a readable safetensors file" in one_error_line(capsys)


def test_attention_flag_rejects_unknown_names(model, capsys):
    assert compile_cli("--model", str(model), "--target", "cpu", "--attention", "flash9", *SMALL) == 1
    assert "Unknown attention implementation 'flash9'" in one_error_line(capsys)


def test_kv_memory_that_does_not_fit(model, capsys):
    args = ["--model", str(model), "--target", "cpu", "--buckets", "8", "--max-model-len", "64"]
    assert compile_cli(*args, "--kv-memory-fraction", "0.000000001") == 1
    assert "does not fit in 0% of" in one_error_line(capsys)
    assert compile_cli(*args, "--kv-tokens", "16") == 1
    assert "--kv-tokens 16 holds less than one sequence of max_model_len 64" in one_error_line(capsys)


def test_tpu_out_of_memory_is_one_sentence(tmp_path, capsys):
    model = tpu_model(tmp_path / "tiny", 4, 2)
    out = tmp_path / "oom"
    args = ["--model", str(model), "--target", "tpu-v5e-1", "--out", str(out), "--buckets", "8", "--max-num-seqs", "4"]
    assert compile_cli(*args, "--kv-tokens", "100000000", "--max-model-len", "512") == 1
    line = one_error_line(capsys)
    assert "init_kv does not fit on a tpu-v5e-1 device" in line and "--kv-tokens" in line
    assert not out.exists() and not (tmp_path / "oom.partial").exists()
