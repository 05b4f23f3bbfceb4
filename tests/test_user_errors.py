"""Every error a user can cause with a model source, through the real CLI (`kiln inspect --model X`): one sentence on
stderr, exit code 1, never a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from tiny_models import make_model

from kiln.models.checkpoint.gguf import SUPPORTED_TYPES

SUPPORTED = ", ".join(t.name for t in SUPPORTED_TYPES)


def write_gguf(path: Path, arch: str = "llama", tensors: dict | None = None, drop: str | None = None) -> None:
    """A small llama-shaped GGUF: metadata of a 1-layer model and the given tensors ({name: (array, raw type)})."""
    w = GGUFWriter(str(path), arch)
    meta = {"block_count": 1, "context_length": 64, "embedding_length": 64, "feed_forward_length": 128}
    for key, value in meta.items():
        if key != drop:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_uint32(f"{arch}.attention.head_count", 4)
    w.add_uint32(f"{arch}.vocab_size", 32)
    for name, (array, raw) in (tensors or {}).items():
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> Path:
    """Folder of broken model sources, one per error."""
    root = tmp_path_factory.mktemp("broken")
    good = root / "good"
    make_model("llama", good)

    def variant(name: str) -> Path:
        shutil.copytree(good, root / name)
        return root / name

    st = variant("corrupt_safetensors") / "model.safetensors"
    st.write_bytes(b"\x07not a safetensors file" * 64)
    st = variant("truncated_safetensors") / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    cfg = variant("unsupported_arch") / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "architectures": ["GPT2LMHeadModel"]}))
    cfg = variant("missing_field") / "config.json"
    cfg.write_text(json.dumps({k: v for k, v in json.loads(cfg.read_text()).items() if k != "hidden_size"}))

    rng = np.random.default_rng(0)
    f32 = {f"blk.0.ffn_{p}.weight": (rng.standard_normal((128, 64)).astype(np.float32), None) for p in ("up", "gate")}
    write_gguf(root / "whole.gguf", tensors=f32)
    data = (root / "whole.gguf").read_bytes()
    (root / "truncated.gguf").write_bytes(data[: int(len(data) * 0.6)])
    (root / "corrupt.gguf").write_bytes(b"GGUF" + bytes(rng.integers(0, 256, 4096, dtype=np.uint8)))
    write_gguf(root / "gpt2.gguf", arch="gpt2")
    write_gguf(root / "no_block_count.gguf", drop="block_count")
    iq4 = {"blk.0.attn_q.weight": (rng.integers(0, 256, (64, 36), dtype=np.uint8), GGMLQuantizationType.IQ4_NL)}
    write_gguf(root / "iq4.gguf", tensors=iq4)
    return root


def kiln_inspect(model: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "kiln.serving.cli", "inspect", "--model", model]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


ERRORS = {
    "missing_folder": r"The model path {p} does not exist \(nor is it a Hugging Face id, org/name\)\.",
    "corrupt_safetensors": r"{p}/model\.safetensors is not a readable safetensors file \(corrupt or truncated: "
    r"Error while deserializing header: [^\n]+\)\.",
    "truncated_safetensors": r"{p}/model\.safetensors is not a readable safetensors file \(corrupt or truncated: "
    r"Error while deserializing header: [^\n]+\)\.",
    "unsupported_arch": r"Unsupported architecture GPT2LMHeadModel; kiln supports LlamaForCausalLM, "
    r"MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, Qwen3MoeForCausalLM, "
    r"MixtralForCausalLM\.",
    "missing_field": r"The model's config\.json lacks the field 'hidden_size'\.",
    "good": r"The model folder {p} has no tokenizer\.json\.",  # weights load; a folder without a tokenizer is refused
    "corrupt.gguf": r"{p} is not a valid GGUF file: it claims \d+ metadata fields and \d+ tensors, more than \d+ "
    r"bytes can hold\.",
    "truncated.gguf": r"{p} is not a valid GGUF file: the tensor [\w.]+ \(\d+ bytes at offset \d+\) runs past the "
    r"end of the file\.",
    "gpt2.gguf": r"Unsupported GGUF architecture gpt2 in {p}; kiln supports llama, mistral, qwen2, qwen3, gemma3\.",
    "no_block_count.gguf": r"{p} lacks the metadata field llama\.block_count\.",
    "iq4.gguf": r"The tensor blk\.0\.attn_q\.weight in {p} has type IQ4_NL, which kiln cannot dequantize "
    rf"\(supported: {SUPPORTED}\)\.",
}


def case_path(cases: Path, case: str) -> Path:
    return cases / case if case != "missing_folder" else cases / "no" / "such" / "folder"


@pytest.fixture(scope="module")
def runs(cases) -> dict[str, subprocess.CompletedProcess]:
    """Every case through the CLI, a few processes at a time (each pays for its own Python and jax start-up)."""
    names = list(ERRORS) + ["whole.gguf"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(names, pool.map(lambda c: kiln_inspect(str(case_path(cases, c))), names), strict=True))


@pytest.mark.parametrize("case", list(ERRORS))
def test_cli_reports_one_sentence(cases, runs, case):
    path, proc = case_path(cases, case), runs[case]
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    pattern = "kiln: error: " + ERRORS[case].format(p=re.escape(str(path))) + "\n"
    assert re.fullmatch(pattern, proc.stderr), proc.stderr


def test_cli_reports_missing_tensors(runs):
    """The truncated file's intact original parses, but holds only two of the model's tensors."""
    proc = runs["whole.gguf"]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    pattern = r"kiln: error: \S+whole\.gguf lacks the tensor model\.embed_tokens\.weight and \d+ more\.\n"
    assert re.fullmatch(pattern, proc.stderr), proc.stderr


def test_cli_inspects_the_default_model():
    """No --model: the embedded SmolLM2-135M-Instruct GGUF, end to end (config, every tensor, tokenizer)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.serving.cli", "inspect"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    lines = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in proc.stdout.splitlines())
    assert lines["architecture"] == "llama" and lines["layers"] == "30"
    assert lines["heads"] == "9 query, 3 key/value, head_dim 64"
    assert lines["parameters"].startswith("134,515,008")
    assert lines["tensor types"] == "Q4_1 x210, F32 x61, Q8_0 x1"
    assert lines["vocab size"] == "49152 (tokenizer 49152)" and lines["chat template"] == "yes"
