"""What a decode program's inputs cost when they come from the host, as the engine passes them: one artifact's
decode_t1 (one live sequence) and decode_t16 (16), 30 calls enqueued back to back, the Batch and SamplingBatch
passed as
  device       the same device arrays every call (what gpu_profile and gpu_decode_buckets time),
  numpy        new numpy arrays each call (Runner.dispatch; the two large sampling fields stay on the device),
  gather       numpy, the token ids read on the device from the last call's tokens (Runner.dispatch_ahead),
  gather+sb    gather, the SamplingBatch on the device (unchanged rows uploaded once),
  gather+tree  gather, one jax.device_put of the whole (batch, sampling) tree,
  gather+pack  gather, every numpy field packed into one int32 buffer, one upload, split by a jitted program.

    python benchmarks/gpu_decode_inputs.py ARTIFACT     # e.g. compiled with --buckets 1,16 --max-num-seqs 16

H200, session 26: numpy inputs cost 0.5% of a call at one sequence and 1.4% at 16; no packing won more than 0.2%.
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kiln.compile.artifact import load
from kiln.models.sampling import SamplingBatch
from kiln.serving.runner import _last_tokens

sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e import decode_inputs  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("artifact")
args = ap.parse_args()
sys.stdout.reconfigure(line_buffering=True)

art = load(args.artifact)
kv = art.make_kv()
ctx, k = 1152, art.decode_steps
MODES = ("device", "numpy", "gather", "gather+sb", "gather+tree", "gather+pack")


def host_inputs(t: int, live: int, call: int) -> tuple:
    # each sequence's pages hold 40 calls' tokens, whichever call this is
    batch, sb = decode_inputs(art, t, live, ctx + call * k, art.cfg.vocab_size, room=(40 - call) * k)
    sb.allowed, sb.history = on_device(sb)
    return batch, sb


_idle = {}


def on_device(sb: SamplingBatch) -> tuple:
    """The two large neutral fields' device copies (made once per S), as Runner.idle_rows keeps them."""
    s = sb.allowed.shape[0]
    if s not in _idle:
        _idle[s] = jax.device_put(sb.allowed), jax.device_put(sb.history)
    return _idle[s]


_split = {}


def packed(tree):
    """tree with its numpy leaves uploaded as one int32 buffer and split on the device by a jitted program."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    host = [(i, x.shape, x.dtype) for i, x in enumerate(leaves) if isinstance(x, np.ndarray)]
    key = tuple((i, shape, str(dt)) for i, shape, dt in host)
    if key not in _split:

        def split(buf):
            out, at = [], 0
            for _, shape, dt in host:
                n = int(np.prod(shape))
                x = buf[at : at + n].reshape(shape)
                out.append(x if dt == np.int32 else jax.lax.bitcast_convert_type(x, jnp.dtype(dt)))
                at += n
            return out

        _split[key] = jax.jit(split)
    buf = np.concatenate([leaves[i].reshape(-1).view(np.int32) for i, _, _ in host])
    for (i, _, _), x in zip(host, _split[key](jax.device_put(buf)), strict=True):
        leaves[i] = x
    return jax.tree_util.tree_unflatten(treedef, leaves)


def ms_a_call(t: int, live: int, mode: str, n: int = 30) -> float:
    global kv
    prog, gather = art.decode_programs[t], art.gathers.get(t, _last_tokens)
    batch0, sb0 = host_inputs(t, live, 0)
    on_dev = jax.device_put((batch0, sb0))
    out, kv = prog(art.weights, kv, *on_dev)
    np.asarray(out.tokens)
    index = np.full(t, -1, np.int32)
    index[:live] = np.arange(live)
    t0 = time.perf_counter()
    for call in range(n):
        batch, sb = on_dev if mode == "device" else host_inputs(t, live, call)
        if mode.startswith("gather"):
            batch.token_ids = gather(out.tokens, index)
        if mode == "gather+sb":
            sb = on_dev[1]
        elif mode == "gather+tree":
            batch, sb = jax.device_put((batch, sb))
        elif mode == "gather+pack":
            batch, sb = packed((batch, sb))
        out, kv = prog(art.weights, kv, batch, sb)
    np.asarray(out.tokens)
    return (time.perf_counter() - t0) / n * 1e3


for t, live in ((1, 1), (16, 16)):
    if t not in art.decode_programs:
        continue
    for mode in MODES:
        ms_a_call(t, live, mode, 3)  # the jitted helpers compile here
    for rep in range(2):
        for mode in MODES:
            ms = ms_a_call(t, live, mode)
            print(f"rep {rep} decode_t{t}, {live} live: {mode:12s} {ms:.2f} ms a call ({ms / k:.3f} ms/token)")
