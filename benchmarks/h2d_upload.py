"""Host-to-device upload of an artifact's weights, by upload mode: what the load's "weights" phase is made of on an
accelerator. Each mode runs in a fresh process (a process's first uploads are what a start pays: on an H200 they ran
at ~2.3 GB/s where the same process's second ran at 24 GB/s), and uploads the tensors of weights.bin up to --gb the
way `kiln.compile.artifact.load` does (kiln.compile.weightfile.Uploads: the sha256 of every chunk checked before its
bytes go up, the load's thread counts), twice: the first pass, then again in the same process. The page cache is
warmed first (one read of the file), so the figures are the uploads and checks alone. Each pass also prints where the
upload threads' time went (summed over the threads): waiting for the checks, and the transfers.

    python benchmarks/h2d_upload.py ARTIFACT [--gb 100] [--modes pieces,pinned,sync,direct] [--best F]

A mode may name its sha256 threads: `pieces@8` (default: the load's, kiln.compile.weightfile.check_threads()).
--prime-gb G: before the first pass, fill G GB of device memory and free it (does the first pass's extra cost lie in
the device memory's first use?).
--best F: write to file F the mode whose first pass was fastest (the mode benchmarks/h200_cold_start.sh starts with;
a mode with @threads is not a candidate).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def child(artifact: str, gb: float, spec: str, prime_gb: float = 0.0) -> None:
    """In this (fresh) process: upload the tensors up to `gb` with `spec` (MODE or MODE@CHECK_THREADS), twice; print
    both rates."""
    t_import = time.perf_counter()
    import jax

    from kiln.compile import weightfile

    dev = jax.devices()[0]
    t_client = time.perf_counter() - t_import
    t_prime = time.perf_counter()
    if prime_gb:
        import jax.numpy as jnp

        jax.block_until_ready(filled := jnp.ones((int(prime_gb * 1e9),), jnp.uint8, device=dev))
        filled.delete()
    t_prime = time.perf_counter() - t_prime
    folder = Path(artifact)
    meta = json.loads((folder / "manifest.json").read_text())["weights"]
    mapped = weightfile.MappedWeights(folder, meta)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    wants, total = {}, 0
    for name, t in sorted(meta["tensors"].items(), key=lambda kv: kv[1]["offset"]):
        if total >= gb * 1e9:
            break
        wants[name] = jax.ShapeDtypeStruct(tuple(t["shape"]), mapped.array(name).dtype, sharding=sharding)
        total += t["bytes"]
    mode, _, checkers = spec.partition("@")
    checkers = int(checkers) if checkers else weightfile.check_threads()
    threads = weightfile.upload_threads(mode)
    rates, parts = [], []
    for _ in range(2):
        t0 = time.perf_counter()
        uploads = weightfile.Uploads(mapped, mode)
        with ThreadPoolExecutor(threads) as up, ThreadPoolExecutor(checkers) as ck:
            jobs, checks = uploads.submit(wants, up, ck)
            out = [f.result() for f in jobs]
            for f in checks:
                f.result()
        rates.append(total / (time.perf_counter() - t0))
        parts.append(" ".join(f"{k} {v:.2f}" for k, v in uploads.seconds.items()))
        del out
    print(f"{spec}: {dev.device_kind}, jax {jax.__version__}, {len(wants)} tensors {total / 1e9:.2f} GB, {threads} "
          f"upload threads, {checkers} check threads, import+client {t_client:.2f} s, "
          f"prime {prime_gb:g} GB {t_prime:.2f} s: first {total / rates[0]:.2f} s "
          f"{rates[0] / 1e9:.2f} GB/s, again {rates[1] / 1e9:.2f} GB/s; thread-seconds first: {parts[0]}; "
          f"again: {parts[1]}", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--gb", type=float, default=100.0, help="bytes of tensors to upload per pass, in GB (default all)")
    p.add_argument("--modes", default="pieces,pinned,sync,direct")
    p.add_argument("--best", default=None, help="write the mode with the fastest first pass here")
    p.add_argument("--prime-gb", type=float, default=0.0, help="fill this much device memory before the first pass")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # (a fresh process: time MODE)
    args = p.parse_args()
    if args.child:
        child(args.artifact, args.gb, args.child, args.prime_gb)
        return
    t0 = time.perf_counter()
    with open(Path(args.artifact) / "weights" / "weights.bin", "rb", buffering=0) as f:  # warm the page cache
        while f.read(64 << 20):
            pass
    print(f"page cache warmed: {time.perf_counter() - t0:.2f} s")
    first: dict[str, float] = {}
    for mode in args.modes.split(","):
        cmd = [sys.executable, __file__, args.artifact, "--gb", str(args.gb), "--child", mode, "--prime-gb",
               str(args.prime_gb)]  # fmt: skip
        run = subprocess.run(cmd, check=False, capture_output=True, text=True)
        print(run.stdout, end="", flush=True)
        if run.returncode:
            print(f"{mode}: failed (exit {run.returncode}): {run.stderr[-600:]}", flush=True)
        if "@" not in mode and (m := re.search(r"first [\d.]+ s ([\d.]+) GB/s", run.stdout)):
            first[mode] = float(m.group(1))
    if args.best and first:
        Path(args.best).write_text(max(first, key=first.get) + "\n")
    print(" ".join(sys.argv))


if __name__ == "__main__":
    main()
