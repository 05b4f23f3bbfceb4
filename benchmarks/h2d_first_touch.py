"""Does a process's first host-to-device upload pay for the device memory's first use, and does XLA's allocator choice
move that cost? On an H200 (issue 15, session 12) a fresh process uploaded 16 GB at 3.85 GB/s, again at 8.1 GB/s;
with 17 GB of device memory filled by a kernel first (1.93 s), the first upload ran at 8.6 GB/s.

Each variant runs in a fresh process with its environment: the device client's start, an optional fill of device
memory (--prime), then two passes of uploads of GB bytes (pieces of 256 MB from 8 threads, each device_put waited for,
the host array written beforehand so that host page faults are not timed), the first's arrays freed before the second.

    python benchmarks/h2d_first_touch.py [--gb 16] [--variants "base;XLA_PYTHON_CLIENT_PREALLOCATE=false;..."]
                                         [--file ARTIFACT/weights/weights.bin]

A variant is space-separated K=V pairs (environment), the word prime (fill GB of device memory first, timed), the word
file (the pieces are views of a fresh read-only mapping of --file, as kiln's load maps weights.bin, read once beforehand
so that it is in the page cache, instead of written anonymous memory) and mb=N (pieces of N MB; kiln's 8B load uploads
195 tensors of 1-1050 MB), pinned (each piece through a page-locked copy, as KILN_UPLOAD=pinned), check (8 more threads
sha256 the pieces during the first pass, as kiln's prefetch checks weights.bin's chunks) and populate (the file mapped
with MAP_POPULATE: its page tables filled at mmap). "base" is kiln serve's environment
(XLA_PYTHON_CLIENT_MEM_FRACTION=0.95, set by kiln's CLI). Issue 15, session 13: kiln's load uploaded 16 GB at ~6.5 GB/s
without the reservation against this script's 11.25 GB/s; e.g. --variants
"XLA_PYTHON_CLIENT_PREALLOCATE=false;XLA_PYTHON_CLIENT_PREALLOCATE=false file;XLA_PYTHON_CLIENT_PREALLOCATE=false file
mb=64" says whether the mapping or the sizes make the difference.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

PIECE = 256 << 20


def child(gb: float, prime: bool, piece: int = PIECE, file: str | None = None, words: frozenset = frozenset()) -> None:
    import hashlib
    import mmap
    import threading

    import numpy as np

    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    t_client = time.perf_counter() - t0
    n = int(gb * 1e9) // piece
    if file is None:
        host = np.ones((n, piece), np.uint8)  # written: its pages are in before the timing
    else:
        with open(file, "rb") as f:
            while f.read(64 << 20):  # in the page cache, as a warm start finds it
                pass
            n = min(n, os.fstat(f.fileno()).st_size // piece)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if "populate" in words else 0)
            region = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
            host = np.frombuffer(region, np.uint8)[: n * piece].reshape(n, piece)
    t_prime = 0.0
    if prime:
        t0 = time.perf_counter()
        jax.block_until_ready(filled := jnp.ones((n * piece,), jnp.uint8, device=dev))
        filled.delete()
        t_prime = time.perf_counter() - t0

    on_device = jax.sharding.SingleDeviceSharding(dev)
    pinned = on_device.with_memory_kind("pinned_host")

    def up(i: int):
        if "pinned" in words:  # kiln's KILN_UPLOAD=pinned: a page-locked copy, then to the device
            staged = jax.device_put(host[i], pinned)
            out = jax.block_until_ready(jax.device_put(staged, on_device))
            staged.delete()
            return out
        return jax.block_until_ready(jax.device_put(host[i], dev))

    stop = threading.Event()

    def check(k: int) -> None:  # sha256 of the pieces k, k + 8, ... while the uploads run (kiln's prefetch checks)
        for i in range(k, n, 8):
            if stop.is_set():
                return
            hashlib.sha256(host[i]).digest()

    rates = []
    for p in range(2):
        checkers = [threading.Thread(target=check, args=(k,)) for k in range(8)] if "check" in words and not p else []
        t0 = time.perf_counter()
        for t in checkers:
            t.start()
        with ThreadPoolExecutor(8) as pool:
            out = list(pool.map(up, range(n)))
        rates.append(n * piece / (time.perf_counter() - t0) / 1e9)
        stop.set()
        for t in checkers:
            t.join()
        for a in out:
            a.delete()
    gb = n * piece / 1e9
    print(f"client {t_client:.2f} s, prime {t_prime:.2f} s, {gb:.1f} GB in {n} pieces: first {rates[0]:.2f} GB/s "
          f"({gb / rates[0]:.2f} s), again {rates[1]:.2f} GB/s", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=16.0)
    p.add_argument("--variants", default="base;prime;XLA_PYTHON_CLIENT_PREALLOCATE=false;"
                   "XLA_PYTHON_CLIENT_ALLOCATOR=platform;XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async")  # fmt: skip
    p.add_argument("--file", default=None, help="the file the variants with the word file upload from")
    p.add_argument("--mb", type=int, default=PIECE >> 20, help=argparse.SUPPRESS)  # (a variant's mb=N)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        words = frozenset(args.child.split(","))
        child(args.gb, "prime" in words, args.mb << 20, args.file if "file" in words else None, words)
        return
    for variant in args.variants.split(";"):
        words = variant.split()
        if "file" in words and not args.file:
            raise SystemExit(f"variant {variant!r} uploads from --file: give one (e.g. ARTIFACT/weights/weights.bin)")
        env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.95")
        env.update(dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("mb=")))
        mb = next((int(w[3:]) for w in words if w.startswith("mb=")), PIECE >> 20)
        kind = ",".join(w for w in ("prime", "file", "pinned", "check", "populate") if w in words) or "plain"
        cmd = [sys.executable, __file__, "--gb", str(args.gb), "--mb", str(mb), "--child", kind]
        cmd += ["--file", args.file] if args.file else []
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        print(f"{variant}: {run.stdout.strip() or 'failed: ' + run.stderr[-400:]}", flush=True)
    print(" ".join(sys.argv))


if __name__ == "__main__":
    main()
