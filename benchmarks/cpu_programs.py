"""What each program of a CPU artifact costs a start, and what serving without it would cost: one process loads the
artifact, deserializes each executable twice (the CPU seconds of the cheaper, and how many YNN mentions its HLO has),
then times the calls that the runner would make with and without a bucket, alternated, median of 7 after 2 warm
calls: decode of 1 and 4 live sequences (context 100) in each decode program that takes them, a 3-token and a 40-token
prefill, a 1-token step.

    python benchmarks/cpu_programs.py ARTIFACT
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax._src.lib import xla_client as xc

from kiln.compile import artifact
from kiln.models.batch import SeqChunk, make_batch
from kiln.models.sampling import SamplingBatch


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    path = Path(sys.argv[1])
    art = artifact.load(path, verify=False)
    dev = jax.devices()[0]
    devices = xc.DeviceList((dev,))
    for name, entry in json.loads((path / "manifest.json").read_text())["programs"].items():
        blob = (path / entry["executable"]).read_bytes()
        costs = []
        for _ in range(2):
            c0 = cpu_seconds()
            exe = dev.client.deserialize_executable(blob, executable_devices=devices)
            costs.append(cpu_seconds() - c0)
        ynn = exe.hlo_modules()[0].to_string().lower().count("ynn")
        del exe
        print(f"deserialize {name}: {min(costs):.2f} CPU-s ({len(blob) / 1e6:.1f} MB, HLO mentions ynn {ynn} times)")
    kv = art.make_kv()

    def call(program, t: int, chunks: list[SeqChunk]) -> float:
        nonlocal kv
        s = art.seqs_per_bucket[t]
        batch = make_batch(chunks, art.page_size, t, s, art.max_pages_per_seq)
        sampling = SamplingBatch.neutral(s, vocab_size=art.cfg.vocab_size)
        t0 = time.perf_counter()
        out, kv = program(art.weights, kv, batch, sampling)
        np.asarray(out.tokens)
        return time.perf_counter() - t0

    def decode(n: int) -> list[SeqChunk]:  # n live sequences at context 100, one new token each
        return [SeqChunk([5], 100, list(range(i * 8, i * 8 + 8))) for i in range(n)]

    def prefill(n: int) -> list[SeqChunk]:
        return [SeqChunk([5] * n, 0, list(range(-(-(n + 1) // art.page_size))))]

    dec, step, k = art.decode_programs, art.programs, art.decode_steps
    cases = [
        ("decode 1 seq", [(f"decode_t{t}", dec.get(t), t) for t in (1, 4, 16)], decode(1), k),
        ("decode 4 seqs", [(f"decode_t{t}", dec.get(t), t) for t in (4, 16)], decode(4), 4 * k),
        ("prefill 3 tokens", [(f"step_t{t}", step.get(t), t) for t in (4, 16)], prefill(3), 0),
        ("step 1 token", [(f"step_t{t}", step.get(t), t) for t in (1, 4, 16)], decode(1), 1),
        ("prefill 40 tokens", [(f"step_t{t}", step.get(t), t) for t in (64, 256)], prefill(40), 0),
    ]
    for label, programs, chunks, tokens in cases:
        programs = [p for p in programs if p[1] is not None]
        for _, program, t in programs:
            for _ in range(2):
                call(program, t, chunks)
        times: dict[str, list[float]] = {name: [] for name, _, _ in programs}
        for _ in range(7):
            for name, program, t in programs:  # alternated
                times[name].append(call(program, t, chunks))
        row = ", ".join(
            f"{name} {statistics.median(v) * 1e3:.0f} ms"
            + (f" ({tokens / statistics.median(v):.1f} tok/s)" if tokens > 1 else "")
            for name, v in times.items()
        )
        print(f"{label}: {row}", flush=True)
    print(" ".join(sys.argv))


if __name__ == "__main__":
    main()
