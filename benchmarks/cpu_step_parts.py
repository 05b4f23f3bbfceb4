"""What a CPU decode step of SmolLM2 (GGUF blocks, kiln's kernel) spends outside its matmuls.

Jits, for T decodes of 100-token sequences (the cpu target's buckets), variants of the gguf model's forward that
drop one part at a time, and the model's matmuls alone with the same shapes and formats (30 layers x 7 custom calls,
plus the Q8_0 LM head); they take turns run by run. Prints wall median (min) and process CPU time per call:

    python benchmarks/cpu_step_parts.py [--runs 20] [--tokens 1,4,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from cpu_matmul import model_batch

from kiln.models import gguf_quant
from kiln.models.batch import KVCache
from kiln.models.checkpoint import default_model_path, load_checkpoint
from kiln.models.kernels import get_attention
from kiln.models.kernels.xla_cpu import write_kv
from kiln.models.quant import quantize_weights
from kiln.models.sampling import sample
from kiln.models.transformer import forward, logits

LAYER = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]  # SmolLM2 (K, N)


def matmul_chain(rng, with_head: bool):
    """The model's matmuls alone: per layer q, k, v, o, gate, up, down in Q4_1, then the Q8_0 head."""
    weights = [[gguf_quant.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, "q4_1") for k, n in LAYER]
               for _ in range(30)]  # fmt: skip
    head = gguf_quant.quantize(rng.standard_normal((49152, 576)).astype(np.float32) * 0.05, "q8_0")

    def run(x, weights, head):
        for lw in weights:
            outs = []
            for (q, s), (k, _) in zip(lw, LAYER, strict=True):
                outs.append(gguf_quant.dot(x if k == 576 else jnp.tile(x, (1, 3))[:, :k], q, s, "q4_1"))
            x = x + 1e-3 * outs[0] + 1e-3 * outs[-1]
        return gguf_quant.dot(x, *head, "q8_0") if with_head else x

    return jax.jit(run), weights, head


def _calls(parts: dict, g, kvs: dict, batch, sampling, chains: dict) -> dict:
    """name -> () -> (output, new KV or None)."""
    calls = {n: (lambda f=f, n=n: f(g, kvs[n], batch, sampling)) for n, f in parts.items()}
    calls.update({n: (lambda c=c: (c[0](*c[1:]), None)) for n, c in chains.items()})
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tokens", default="1,4,16")
    args = ap.parse_args()
    cfg, w = load_checkpoint(default_model_path())
    g = jax.device_put(quantize_weights(w, "gguf", source=default_model_path()))
    attention = get_attention("xla_cpu")

    def kv_only(q, k, v, kp, vp, batch, **_):
        kp, vp = write_kv(kp, vp, k, v, batch.slot_mapping)
        return q, kp, vp

    def nothing(q, k, v, kp, vp, batch, **_):
        return q, kp, vp

    def fwd(att, head: bool):
        def f(w, kv, b, s):
            h, kv = forward(cfg, w, kv, b, attention=att)
            return (logits(cfg, w, h[b.logits_index]) if head else h), kv

        return jax.jit(f, donate_argnums=1)

    def sampler(w, kv, b, s):
        lg = jnp.zeros((s.temperature.shape[0], cfg.vocab_size)) + b.seq_lens[:, None].astype(jnp.float32)
        return sample(lg, s, b.seq_lens), kv

    rng = np.random.default_rng(0)
    chain, cw, ch = matmul_chain(rng, False)
    chain_head, _, _ = matmul_chain(rng, True)
    print(f"jax {jax.__version__}; wall median (min) ms | CPU median ms")
    for t in [int(x) for x in args.tokens.split(",")]:
        batch, sampling = model_batch(t, 16, cfg.vocab_size)
        x = jnp.asarray(rng.standard_normal((t, 576)).astype(np.float32))
        parts = {
            "forward + LM head": fwd(attention, True),
            "forward": fwd(attention, False),
            "forward, attention = KV write only": fwd(kv_only, False),
            "forward, no attention, no KV write": fwd(nothing, False),
            "sampler alone": jax.jit(sampler, donate_argnums=1),
        }
        kvs = {n: KVCache.create(cfg, 16 * 8 + 32, 16, jnp.float32) for n in parts}
        chains = {"matmuls alone (30 layers)": (chain, x, cw, ch), "matmuls alone + LM head": (chain_head, x, cw, ch)}
        calls = _calls(parts, g, kvs, batch, sampling, chains)
        wall = {n: [] for n in calls}
        cpu = {n: [] for n in calls}
        for i in range(args.runs + 2):
            for n, call in calls.items():
                t0, c0 = time.perf_counter(), time.process_time()
                out, kv = call()
                jax.block_until_ready(out)
                if kv is not None:
                    kvs[n] = kv
                if i >= 2:
                    wall[n].append(time.perf_counter() - t0)
                    cpu[n].append(time.process_time() - c0)
        for n in calls:
            print(f"| T={t} | {n} | {1e3 * statistics.median(wall[n]):.2f} ({1e3 * min(wall[n]):.2f}) | "
                  f"{1e3 * statistics.median(cpu[n]):.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
