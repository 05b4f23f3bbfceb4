"""Multi-host serving (kiln.serving.multihost) on this machine: a tp=4 artifact of a tiny Llama served by two
`kiln serve` processes of 2 CPU devices each (jax.distributed, gloo collectives) gives the greedy completions of one
process with 4 devices; killing the follower ends the leader within 10 s with one sentence."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REFERENCE = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tiny_models import make_model
from tiny_tokenizer import write_tokenizer
import jax
from kiln.compile.build import compile_artifact
from kiln.serving.llm import build_engine
from kiln.serving.params import SamplingParams

root = Path(sys.argv[1])
assert len(jax.devices()) == 4
make_model("llama_tied", root / "model", num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
write_tokenizer(root / "model")
art = compile_artifact(root / "model", "cpu", out=root / "tp4", tp=4, buckets=(16,), max_num_seqs=4, kv_tokens=256,
                       max_model_len=64, decode_steps=1)
engine = build_engine(str(art))
texts = {}
for i, prompt in enumerate(json.loads(sys.argv[3])):
    engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, temperature=0.0))
    texts[str(i)] = ""
while engine.has_unfinished():
    for out in engine.step():
        texts[out.request_id] += out.new_text
print("TEXTS " + json.dumps([texts[str(i)] for i in range(len(texts))]))
"""

PROMPTS = [[5, 9, 17, 33, 65, 129, 7], [42, 43, 44]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int) -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def complete(port: int, prompt: list[int]) -> str:
    body = json.dumps({"model": "tp4", "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]["text"]


def test_two_processes_serve_like_one(tmp_path: Path):
    ref = subprocess.run(
        [sys.executable, "-c", REFERENCE, str(tmp_path), str(Path(__file__).parent), json.dumps(PROMPTS)],
        env=env(4), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = json.loads(ref.stdout.split("TEXTS ", 1)[1])
    assert all(want), want  # eight greedy tokens each

    coord, port = f"127.0.0.1:{free_port()}", free_port()
    kiln = [sys.executable, "-m", "kiln.serving.cli", "serve", str(tmp_path / "tp4"), "--coordinator", coord,
            "--num-processes", "2"]  # fmt: skip
    logs = [open(tmp_path / f"p{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [*kiln, "--process-id", str(i), "--port", str(port)], env=env(2), stdout=logs[i], stderr=subprocess.STDOUT
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 180
        while True:
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the two processes did not come up"
            time.sleep(0.5)
        assert [complete(port, p) for p in PROMPTS] == want

        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = procs[0].wait(timeout=10)
        assert time.monotonic() - t0 < 10 and rc != 0
        said = (tmp_path / "p0.log").read_text()
        assert "kiln: process 1 of 2 stopped answering" in said, said[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for f in logs:
            f.close()


@pytest.mark.parametrize(
    "args,needle",
    [
        (("--coordinator", "127.0.0.1:1"), "needs all of --coordinator"),
        (("--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"), "--process-id must be"),
    ],
)
def test_bad_multihost_options(args, needle):
    from kiln.models.errors import KilnError
    from kiln.serving import multihost

    opts = dict(zip(("coordinator", "num_processes", "process_id"), (None, None, None), strict=True))
    it = iter(args)
    for flag in it:
        value = next(it)
        key = flag.lstrip("-").replace("-", "_")
        opts[key] = int(value) if key != "coordinator" else value
    with pytest.raises(KilnError, match=needle):
        multihost.requested(opts["coordinator"], opts["num_processes"], opts["process_id"], False)


def test_k8s_slice_manifest_matches_the_target():
    """targets/k8s/tpu-multihost.yaml: one pod per host of the tpu-v5e-16 slice, its chips, --multihost, the
    Service on pod 0 only."""
    import yaml

    from kiln.targets.target import get_target

    docs = {d["kind"]: d for d in yaml.safe_load_all((Path(__file__).parents[1] / "targets" / "k8s" /
                                                      "tpu-multihost.yaml").read_text()) if d}  # fmt: skip
    job = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    kiln = pod["containers"][0]
    target = get_target("tpu-v5e-16")
    assert job["parallelism"] == job["completions"] == 4
    chips = kiln["resources"]["limits"]["google.com/tpu"]
    assert chips * job["parallelism"] == target.device_count
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == target.topology.split(":")[1]
    assert "--multihost" in kiln["args"] and target.name in kiln["volumeMounts"][0]["subPath"]
    assert docs["Service"]["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
