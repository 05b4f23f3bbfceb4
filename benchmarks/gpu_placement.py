"""Is a decode program's speed a property of where its buffers lie? Sessions 26-31 saw the same artifact's decode_t1
run at one of two speeds, a process at a time (H100: 45.1 or 46.6 ms a call, 3%; the same in every rep of a process;
not the clocks, the CPU the process ran on, the upload mode or the address span of the weights). Here one process
times the program, then moves the KV cache, then the weights, to new buffers (a copy on the device, the old one
deleted: the allocator hands out other memory while the old is alive), timing after each move.

    python benchmarks/gpu_placement.py ARTIFACT [--moves 3] [--bucket 1]
"""

import argparse
import sys
from pathlib import Path

import jax

from kiln.compile.artifact import load

sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e import decode_inputs, pipelined_ms  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("artifact")
ap.add_argument("--moves", type=int, default=3, help="moves of each kind")
ap.add_argument("--bucket", type=int, default=1, help="the decode program's token bucket")
args = ap.parse_args()
sys.stdout.reconfigure(line_buffering=True)

art = load(args.artifact)
weights, kv = art.weights, art.make_kv()
prog = art.decode_programs[args.bucket]
batch, sb = jax.device_put(decode_inputs(art, args.bucket, 1, 1152, art.cfg.vocab_size))
copy = jax.jit(lambda x: x.copy())


def moved(tree):
    new = jax.tree.map(copy, tree)
    jax.block_until_ready(new)
    for leaf in jax.tree.leaves(tree):
        leaf.delete()
    return new


def first(tree) -> str:
    return f"{jax.tree.leaves(tree)[0].unsafe_buffer_pointer():#x}"


def timed(what: str) -> None:
    global kv
    _, kv = pipelined_ms(prog, weights, kv, batch, sb, 3)
    ms = []
    for _ in range(3):
        m, kv = pipelined_ms(prog, weights, kv, batch, sb, 20)
        ms.append(m)
    print(f"{what:<16} decode_t{args.bucket} {' '.join(f'{m:.2f}' for m in ms)} ms a call   "
          f"weights at {first(weights)}, cache at {first(kv)}")  # fmt: skip


timed("as loaded")
for i in range(args.moves):
    kv = moved(kv)
    timed(f"cache moved {i + 1}")
for i in range(args.moves):
    weights = moved(weights)
    timed(f"weights moved {i + 1}")
