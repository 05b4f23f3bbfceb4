"""Host-to-device upload rate of an artifact's weights, by upload mode and threads: what the load's "weights" phase
is made of on an accelerator. Maps weights.bin (kiln.compile.weightfile), takes its tensors in file order up to
--gb, and places them on device 0 the way `kiln.compile.artifact.load` does (weightfile.place on a thread pool), for
each mode (direct: device_put of the mapped pageable bytes; pinned: through a page-locked copy) and thread count.
One pass first warms the page cache, so the figures are the upload alone. Also the two legs of a pinned upload of the
largest tensor: host -> pinned host, pinned host -> device.

    python benchmarks/h2d_upload.py ARTIFACT [--gb 4] [--threads 1,8] [--modes direct,pinned,read] [--best F] [--fresh]

--fresh: first, each mode's first upload (at the most threads) in a fresh process, as a start pays it: on the H200 the
first upload of a process ran at 1.0 GB/s where the same process's second ran at 24 GB/s.
--best F: write to file F the fastest mode at the most threads, in fresh processes with --fresh (the mode
benchmarks/h200_cold_start.sh starts with).
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

import jax
import numpy as np

from kiln.compile import weightfile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--gb", type=float, default=4.0, help="bytes of tensors to upload per run, in GB (default 4)")
    p.add_argument("--threads", default="1,8")
    p.add_argument("--modes", default=",".join(weightfile.UPLOADS))
    p.add_argument("--best", default=None, help="write the fastest mode at the most threads here")
    p.add_argument("--fresh", action="store_true", help="first, each mode's first upload in a process of its own")
    p.add_argument("--first", default=None, help=argparse.SUPPRESS)  # (--fresh's child: time MODE's first upload)
    args = p.parse_args()
    fresh: dict[str, float] = {}
    if args.fresh:  # what a start pays: the process's first uploads, from a mapping it has not touched yet
        for mode in args.modes.split(","):
            cmd = [sys.executable, __file__, args.artifact, "--gb", str(args.gb), "--first", mode, "--threads",
                   str(max(map(int, args.threads.split(","))))]  # fmt: skip
            out = subprocess.run(cmd, check=False, capture_output=True, text=True).stdout
            print(out, end="", flush=True)
            if m := re.search(r"([\d.]+) GB/s", out):
                fresh[mode] = float(m.group(1))
    folder = Path(args.artifact)
    meta = json.loads((folder / "manifest.json").read_text())["weights"]
    mapped = weightfile.MappedWeights(folder, meta)
    dev = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    names, total = [], 0
    for name, t in sorted(meta["tensors"].items(), key=lambda kv: kv[1]["offset"]):
        if total >= args.gb * 1e9:
            break
        names.append(name)
        total += t["bytes"]
    specs = {n: jax.ShapeDtypeStruct(tuple(meta["tensors"][n]["shape"]), mapped.array(n).dtype, sharding=sharding)
             for n in names}  # fmt: skip
    if args.first:  # this process's first upload: every per-process cost (staging buffers, mapping) included
        threads = max(map(int, args.threads.split(",")))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            out = list(pool.map(lambda n: weightfile.place(mapped, n, specs[n], args.first), names))
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        print(f"fresh process, first upload, {args.first}, {threads} threads: {dt:.2f} s, {total / 1e9 / dt:.2f} GB/s")
        return
    print(f"{dev.device_kind}, jax {jax.__version__}: {len(names)} tensors, {total / 1e9:.2f} GB per run")
    t0 = time.perf_counter()
    for n in names:  # page cache warm and the mapping's pages touched: the runs time the upload alone
        int(np.asarray(mapped.array(n)).view(np.uint8)[:: 1 << 12].sum())
    print(f"touching every page of the mapping: {time.perf_counter() - t0:.2f} s")
    print("| mode | threads | seconds | GB/s |\n|---|---:|---:|---:|")
    most, rates = max(map(int, args.threads.split(","))), {}
    for mode in args.modes.split(","):
        for threads in map(int, args.threads.split(",")):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                out = list(pool.map(lambda n, m=mode: weightfile.place(mapped, n, specs[n], m), names))
            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
            print(f"| {mode} | {threads} | {dt:.2f} | {total / 1e9 / dt:.2f} |", flush=True)
            del out
            if threads == most:
                rates[mode] = total / dt
    if args.best:  # the fresh-process rate where measured: that is what a start pays
        best = fresh or rates
        Path(args.best).write_text(max(best, key=best.get) + "\n")
    big = max(names, key=lambda n: meta["tensors"][n]["bytes"])
    host = mapped.array(big)
    for _ in range(2):  # the second is the steady state
        t0 = time.perf_counter()
        staged = jax.device_put(host, sharding.with_memory_kind("pinned_host"))
        staged.block_until_ready()
        t1 = time.perf_counter()
        out = jax.device_put(staged, sharding)
        out.block_until_ready()
        t2 = time.perf_counter()
        del staged, out
    gb = host.nbytes / 1e9
    print(f"pinned legs of {big} ({gb:.2f} GB): host -> pinned {gb / (t1 - t0):.2f} GB/s, "
          f"pinned -> device {gb / (t2 - t1):.2f} GB/s")  # fmt: skip
    print(" ".join(sys.argv))


if __name__ == "__main__":
    main()
