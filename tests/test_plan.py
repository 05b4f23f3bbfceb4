"""One plan (kiln.compile.plan): `kiln compile` and the jit path (build_engine, LLM, kiln generate) plan a model the
same way, every option checked once; and the habits users bring from vLLM."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from server_harness import tiny_folder

from kiln.compile import ensure_artifact
from kiln.compile.plan import Options, resolve_target
from kiln.models.errors import KilnError
from kiln.serving.llm import build_engine, startup_report
from kiln.targets.target import BUILTIN

pytestmark = pytest.mark.usefixtures("cheap_compiles")  # tiny models: compiling costs more than running

SMALL = dict(buckets=(4, 16), max_num_seqs=4, max_model_len=128, kv_tokens=512, decode_steps=4)


def test_the_jit_path_runs_the_plan_of_the_artifact(tmp_path):
    """Same options -> same buckets, sequences per bucket, decode programs, KV pages, context and attention."""
    art = build_engine(ensure_artifact(str(tiny_folder()), "cpu", out=str(tmp_path / "art"), **SMALL))
    jit = build_engine(str(tiny_folder()), **SMALL)
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    for engine in (art, jit):
        assert engine.runner.buckets == (4, 16) and engine.runner.seqs_per_bucket == {4: 4, 16: 4}
        assert sorted(engine.runner.decode) == [4] and engine.decode_steps == 4
        assert engine.scheduler.bm.num_pages == 512 // 16 and engine.max_model_len == 128
    assert manifest["geometry"]["attention"] == BUILTIN["cpu"].attention == "xla_cpu"
    assert "load" in startup_report(art)
    jit.runner.startup["warmup"] = 0.1  # what _assemble records for `kiln serve --target jit` (it warms up)
    assert startup_report(jit) == ""  # no artifact load to report (this raised KeyError 'load' in the loader)


def test_the_jit_path_defaults_to_the_targets_fast_path():
    target = resolve_target("cpu", Options())
    assert (target.attention, target.compute_dtype, target.decode_steps) == ("xla_cpu", "float32", 4)
    assert resolve_target("cpu", Options(attention="reference")).attention == "reference"  # the debugging switch


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(dtype="float64"), "Unknown dtype"),
        (dict(kv_dtype="int3"), "Unknown KV dtype"),
        (dict(attention="flash"), "Unknown attention implementation"),
        (dict(decode_steps=0), "--decode-steps must be a positive number"),
        (dict(max_num_seqs=-1), "--max-num-seqs must be a positive number"),
        (dict(kv_dtype="fp8", attention="pallas_tpu"), "fp8 KV cache needs"),
        (dict(colour="blue"), "Unknown option 'colour'"),
        (dict(tp=2), "Tensor parallelism needs an artifact"),
        (dict(expert_parallel=True), "--expert-parallel needs a mixture-of-experts model"),
    ],
)
def test_each_option_is_checked_once_for_both_paths(options, message):
    with pytest.raises(KilnError, match=message):
        build_engine(str(tiny_folder()), **options)


def test_sampling_params_import_like_vllm():
    from kiln.serving import LLM, SamplingParams

    assert LLM.__name__ == "LLM" and SamplingParams(max_tokens=3).max_tokens == 3


def test_compile_logs_progress_when_not_on_a_terminal(tmp_path):
    """Docker builds and CI see a line per program and weight step (stderr is a pipe, so tqdm's bar is off)."""
    argv = ["--model", str(tiny_folder()), "--target", "cpu", "--out", str(tmp_path / "a"), "--buckets", "8",
            "--max-num-seqs", "4", "--kv-tokens", "256", "--max-model-len", "64", "--decode-steps", "1"]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "kiln.serving.cli", "compile", *argv], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    for needle in ("weights:", "step_t8: exported", "step_t8: compiled", "init_kv: exported"):
        assert needle in run.stderr, run.stderr


def test_a_mixture_of_experts_gets_a_one_row_bucket():
    """On targets whose buckets start above 1, a MoE model decodes one sequence in a 1-row bucket (its gather dispatch
    copies every row's experts, padding rows too); dense models and explicit --buckets keep theirs."""
    from kiln.compile.plan import make_geometry
    from kiln.models.config import ModelConfig

    dense = ModelConfig(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024)  # fmt: skip
    moe = ModelConfig(**{**dense.to_dict(), "family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32})  # fmt: skip

    def buckets(cfg, **options):
        opts = Options(kv_tokens=4096, **options)
        return make_geometry(cfg, resolve_target("cuda", opts), opts, tp=1, weight_bytes=0).buckets

    cuda = BUILTIN["cuda"].token_buckets
    assert buckets(dense) == cuda and buckets(moe) == (1, *cuda)
    assert buckets(moe, buckets=(16, 64)) == (16, 64)
