"""Hugging Face Hub ids as model sources (kiln.models.checkpoint.hub), offline against a Hub cache laid out on disk
the way huggingface_hub writes it (models--org--name/refs/main + snapshots/REV/...), with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import tiny_folder

from kiln.models.checkpoint import default_model_path, hub

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf") / "hub"
    snap = root / "models--kiln-test--tiny-llama" / "snapshots" / REV
    shutil.copytree(tiny_folder(), snap)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text(REV)
    gguf = root / "models--kiln-test--smol-gguf" / "snapshots" / REV
    gguf.mkdir(parents=True)
    (gguf / "smol.gguf").symlink_to(default_model_path())
    (gguf.parent.parent / "refs").mkdir()
    (gguf.parent.parent / "refs" / "main").write_text(REV)
    return root


def kiln(cache: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", **env}
    cmd = [sys.executable, "-m", "kiln.serving.cli", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)


def test_ids_parse():
    assert hub.parse("org/name") == ("org/name", None, None)
    assert hub.parse("org/name@v1.0") == ("org/name", "v1.0", None)
    assert hub.parse("org/name:model-Q4_K_M.gguf") == ("org/name", None, "model-Q4_K_M.gguf")
    assert hub.parse("./org/name") is None and hub.parse("/abs/path") is None and hub.parse("name") is None


def test_an_id_resolves_from_the_cache_offline(cache):
    for ref in ("kiln-test/tiny-llama", f"kiln-test/tiny-llama@{REV}"):
        run = kiln(cache, "inspect", "--model", ref)
        assert run.returncode == 0, run.stderr
        assert f"snapshots/{REV}" in run.stdout and "llama" in run.stdout
    run = kiln(cache, "inspect", "--model", "kiln-test/smol-gguf:smol.gguf")
    assert run.returncode == 0 and "Q4_1" in run.stdout, run.stderr


@pytest.mark.parametrize(
    "ref, says",
    [
        ("kiln-test/absent", "not in the Hugging Face cache"),
        ("kiln-test/tiny-llama@nope", "not in the Hugging Face cache"),
        ("kiln-test/smol-gguf:other.gguf", "not in the Hugging Face cache"),
    ],
)
def test_a_missing_id_is_one_sentence(cache, ref, says):
    run = kiln(cache, "inspect", "--model", ref)
    assert run.returncode == 1 and says in run.stderr and "Traceback" not in run.stderr
    assert ref.split("@")[0].split(":")[0] in run.stderr


def test_an_artifact_is_named_after_the_id_and_records_it(cache, tmp_path):
    run = kiln(cache, "compile", "--model", "kiln-test/tiny-llama", "--target", "cpu", "--buckets", "8",
               "--max-num-seqs", "4", "--kv-tokens", "256", "--max-model-len", "64", "--decode-steps", "1",
               KILN_ARTIFACTS=str(tmp_path))  # fmt: skip
    assert run.returncode == 0, run.stderr
    manifest = json.loads((tmp_path / "tiny-llama.cpu" / "manifest.json").read_text())
    assert manifest["source"]["hub"] == {"id": "kiln-test/tiny-llama", "revision": REV}
