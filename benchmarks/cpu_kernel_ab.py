"""Two builds of kiln's CPU matmul kernel (models/kernels/cpu_quant.cc) against each other on SmolLM2's GGUF shapes:
each build's kiln_gguf_matmul_serial (one thread, no XLA) on the same random blocks, the two taking turns call by
call; per cell the median over --runs rounds of this thread's CPU time (time.thread_time: a shared machine's load
inflates it far less than wall time). Build a second library with the setup.py flags, e.g.

    g++ -std=c++17 -O3 -shared -fPIC -I$(python -c "import jax.ffi; print(jax.ffi.include_dir())") \\
        models/kernels/cpu_quant.cc -o /tmp/new.so
    python benchmarks/cpu_kernel_ab.py OLD.so /tmp/new.so [--rows 1,4,16,64] [--isa 2,3]

--isa A,B pins each build's SIMD path (kiln_cpu_quant_set_isa: 0 scalar, 1 AVX2, 2 AVX-VNNI, 3 AVX-512 VNNI); the same
file twice needs two copies of it (one process loads a path once).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

KINDS = {"q8_0": (0, 32, 1), "q4_0": (1, 16, 1), "q4_1": (2, 16, 2)}  # kind id, q bytes and float16s per block
SHAPES = [("q8_0", 576, 49152), ("q4_1", 576, 1536), ("q4_1", 1536, 576), ("q4_1", 576, 192)]  # head, up, down, k/v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("libs", nargs=2)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--isa", default=None)
    args = ap.parse_args()
    ptr = ctypes.c_void_p
    libs = [ctypes.CDLL(p) for p in args.libs]
    for i, lib in enumerate(libs):
        lib.kiln_gguf_matmul_serial.argtypes = [ptr] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int32]
        if args.isa:
            want = int(args.isa.split(",")[i])
            if lib.kiln_cpu_quant_set_isa(want) != want:
                raise SystemExit(f"{args.libs[i]} cannot run ISA {want} here")
    rng = np.random.default_rng(0)
    print("| kind | K x N | M | A ms | B ms | B / A | B GMAC/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, k, n in SHAPES:
        kid, qbytes, halves = KINDS[kind]
        q = rng.integers(0, 256, size=(n, k // 32 * qbytes), dtype=np.uint8)
        s = (rng.standard_normal((n, k // 32 * halves)) * 0.01).astype(np.float16)
        for m in [int(r) for r in args.rows.split(",")]:
            x = rng.standard_normal((m, k)).astype(np.float32)
            outs = [np.empty((m, n), np.float32) for _ in libs]
            times: list[list[float]] = [[], []]
            reps = max(3, int(4e7 // (m * k * n)))
            for _ in range(args.runs):
                for i, lib in enumerate(libs):
                    t0 = time.thread_time()
                    for _ in range(reps):
                        lib.kiln_gguf_matmul_serial(x.ctypes.data, q.ctypes.data, s.ctypes.data, outs[i].ctypes.data,
                                                    m, k, n, kid)  # fmt: skip
                    times[i].append((time.thread_time() - t0) / reps)
            np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4 * np.abs(outs[0]).max())
            a, b = (float(np.median(t)) * 1e3 for t in times)
            print(f"| {kind} | {k}x{n} | {m} | {a:.3f} | {b:.3f} | {b / a:.2f} | {m * k * n / b / 1e6:.1f} |")


if __name__ == "__main__":
    main()
