"""Decode programs loaded again before ready, the faster instance kept (issue 16).

On a GPU one decode executable runs at one of two speeds, an instance at a time, set when it loads: an H100 ran the
Llama-3-8B shape's decode_t1 at 45.3-45.5 or 46.8-46.9 ms a call of 8 steps (3.4% apart), 13 of 18 instances fast
in three processes, each steady over its 60 calls (session 34, benchmarks/gpu_reload.py); the time between kernels
is what differs (session 32). settle() loads each decode program again (LoadedArtifact.instance), times the two
instances in turn on a batch that writes no K/V (warm_quietly), and keeps the faster; a bucket is done once two
instances differ by more than MARGIN (both speeds seen) or after `tries` new instances.

KILN_SETTLE=N sets the tries (0, the default: off until a served run measures it; each try costs a deserialization,
~1-1.5 s for the 8B decode_t1, and ~1 s of timing).
"""

import logging
import os
import time

from kiln.models.errors import KilnError
from kiln.serving.llm import warm_quietly

log = logging.getLogger("kiln")

MARGIN = 0.01  # two instances this far apart run at different speeds (the two speeds: 3.4%; one instance: +-0.2%)
CALLS = 4  # calls of a program per timing; each instance is timed twice, alternated, and its faster timing kept


def tries_from_env() -> int:
    """KILN_SETTLE: new instances to try per decode program (0 or unset: none). Refused in one sentence if not a
    non-negative integer."""
    raw = os.environ.get("KILN_SETTLE", "0")
    if not raw.isdigit():
        raise KilnError(f"KILN_SETTLE must be a non-negative integer (new instances per decode program), not {raw!r}")
    return int(raw)


def seconds(runner, program, t: int) -> float:
    """Seconds a call of decode program `program` (bucket t, already run once) takes, over CALLS calls that write no
    K/V."""
    t0 = time.perf_counter()
    for _ in range(CALLS):
        warm_quietly(runner, program, t, decode=True)
    return (time.perf_counter() - t0) / CALLS


def settle(art, runner, tries: int) -> None:
    """For each of the runner's decode programs, up to `tries` new instances from `art` (a LoadedArtifact), the
    faster of each pair kept in the runner."""
    for t in sorted(runner.decode):
        name = f"decode_t{t}"
        for i in range(tries):
            old, new = runner.decode[t], art.instance(name)
            warm_quietly(runner, new, t, decode=True)  # its first call records the new instance's graphs
            a, b = seconds(runner, old, t), seconds(runner, new, t)
            a, b = min(a, seconds(runner, old, t)), min(b, seconds(runner, new, t))  # alternated: old, new, old, new
            if b < a:
                runner.install(t, new, decode=True)
            log.info("kiln: %s instance %d %.2f ms a call against %.2f: kept the %s", name, i + 2, b * 1e3, a * 1e3,
                     "new" if b < a else "old")  # fmt: skip
            if abs(a - b) > MARGIN * min(a, b):
                break  # the two speeds seen, the faster kept
