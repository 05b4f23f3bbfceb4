"""Is a decode program's speed a property of its executable's instance (the CUDA graphs XLA records for it) or of
the process? Sessions 26-33 saw the same artifact's decode_t1 run at one of two speeds, a process at a time (H100:
44.8 or 46.3 ms a call; H200: 34.2 or 35.8), the difference all in the gaps between kernels (session 32), unchanged
by moving the weights or the KV cache to new buffers (session 31, gpu_placement.py), by CUDA_MODULE_LOADING=EAGER
or CUDA_DEVICE_MAX_CONNECTIONS=32 (session 33). Here one process times the artifact's decode program as loaded, then
deserializes the same executable again (a new instance: new command buffers, recorded at its first call) several
times, each timed on the same weights and cache, the old instance deleted first. If the speed changes between
instances, a server could re-instance a slow program at its start; if not, the process (its CUDA context) sets it.
(Session 34, H100: the instance sets it, both speeds in every process. Keeping the faster of new instances at a
server's start, KILN_SETTLE, was measured served and removed: 167.1-167.4 tok/s at c = 1 with it, 167.3-167.8 without,
10.5-12.3 s more start; in the server every new instance timed within 0.6% of its rival, 18 tries.)

    python benchmarks/gpu_reload.py ARTIFACT [--reloads 4] [--bucket 1] [--keep]
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import jax

from kiln.compile import executable, lower
from kiln.compile.artifact import load
from kiln.compile.checks import check_file

sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e import decode_inputs, pipelined_ms  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("artifact")
ap.add_argument("--reloads", type=int, default=4, help="new instances of the program after the loaded one")
ap.add_argument("--bucket", type=int, default=1, help="the decode program's token bucket")
ap.add_argument("--calls", type=int, default=20, help="calls back to back per figure (three figures an instance)")
ap.add_argument("--keep", action="store_true", help="keep every instance alive (default: delete the old one first)")
args = ap.parse_args()
sys.stdout.reconfigure(line_buffering=True)

folder = Path(args.artifact)
art = load(folder)
weights, kv = art.weights, art.make_kv()
name = f"decode_t{args.bucket}"
batch, sb = jax.device_put(decode_inputs(art, args.bucket, 1, 1152, art.cfg.vocab_size))


def _instance(art, name: str):
    """A new instance of the loaded artifact's program `name`: its executable read again, checked against the
    manifest's sha256 and deserialized onto the devices load() used."""
    rel = art.manifest["programs"][name]["executable"]
    data = check_file(art.path, rel, art.manifest["files"][rel])
    program = lower.program(art.cfg, art.geometry, art.mesh, art.manifest["step_out"], name)
    return executable.load_executable(data, program, jax.devices()[: art.geometry.tp])


def timed(what: str, prog) -> list[float]:
    global kv
    _, kv = pipelined_ms(prog, weights, kv, batch, sb, 3)  # the first calls: the graphs are recorded here
    ms = []
    for _ in range(3):
        m, kv = pipelined_ms(prog, weights, kv, batch, sb, args.calls)
        ms.append(m)
    print(f"{what:<14} {name} {' '.join(f'{m:.2f}' for m in ms)} ms a call of {art.decode_steps} steps")
    return ms


figures = [timed("as loaded", art.decode_programs[args.bucket])]
instances = []  # the new instances alive (only the latest without --keep)
for i in range(args.reloads):
    if not args.keep:
        art.decode_programs.pop(args.bucket, None)
        instances.clear()
        gc.collect()
    t0 = time.perf_counter()
    instances.append(_instance(art, name))  # read, checked and deserialized again
    print(f"instance {i + 2}: loaded in {time.perf_counter() - t0:.2f} s")
    figures.append(timed(f"instance {i + 2}", instances[-1]))
medians = sorted(sorted(f)[1] for f in figures)
print(f"instances: {len(figures)}, median ms a call from {medians[0]:.2f} to {medians[-1]:.2f} "
      f"({(medians[-1] / medians[0] - 1) * 100:.1f}% apart)")  # fmt: skip
