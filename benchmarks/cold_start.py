"""Cold start of `kiln serve` from one artifact: N fresh processes, each timed from its start to `/health` 200, with
the phases of its ready log line (imports, the artifact's load: manifest, checksums, executables, weights; KV cache,
tokenizer, warm-up, server), the CPU seconds it used until then (cpu_200, from /proc) and, after ready, the latency
of a few one-token completions (the first against the later ones: nothing may be left to warm up after ready).

    python benchmarks/cold_start.py ARTIFACT [-n 5] [--requests 10] [--json out.json] [--drop-caches] [--idle S]

ARTIFACT "-": plain `kiln serve` (the embedded model, the laptop user's command), whose artifact ensure_artifact finds
under KILN_ARTIFACTS (with --trees: each tree's own artifacts/ folder); one start per tree comes first, not counted
(it compiles that tree's artifact where it must).

--idle S: after the requests, leave the server idle up to S seconds for the programs a CPU start deferred (its log line
"every program loaded"), and report when the last was in (all_programs_s, seconds after the engine started).

--drop-caches (root, Linux) empties the page cache before every start, so the weights come from the disk (and
--drop-caches artifact drops the artifact's files only: the libraries stay cached); read_gb is what the server read
from storage until ready (/proc/PID/io), the weights and whatever else the start needed; the disk's
read rate is measured on weights.bin (also uncached; one reader in order, and 8 readers as kiln's checks read) before
the first start and after the last, and the ratio taken against the faster's mean (one H200 machine's disk read 1.29
and 1.44 GB/s minutes apart: issue 15, round 10).

--envs "K=V K2=V2,K=W": variants of the environment (each item space-separated K=V pairs, items comma-separated),
started alternately like --trees (A B C, C B A, ...), one table each; e.g.
--envs "XLA_PYTHON_CLIENT_PREALLOCATE=false,XLA_PYTHON_CLIENT_PREALLOCATE=true".

--trees A,B: an A/B of two kiln trees (each a folder holding kiln/, put first on PYTHONPATH), started alternately
(A B, B A, A B, ...: -n starts of each), with one table per tree; a tree from a commit:
`mkdir -p /tmp/a/kiln && git archive REV | tar -x -C /tmp/a/kiln` (and a built models/kernels/_cpu_quant*.so copied).
Prints a table of medians and the command that produced it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

PHASES = ("imports", "load", "manifest", "checksums", "executables", "weights", "kv", "tokenizer", "warmup", "server",
          "total", "cpu")  # fmt: skip


# /health is polled every 25 ms: the server answers 503 while it loads, and each answer takes the loading process's
# CPU (~1 ms each on the 2-core machine, so cpu_200 holds ~0.04 CPU-s per second of the start; at 5 ms, 200 polls a
# second cost SmolLM2's start ~6 more CPU-seconds)
POLL_S = 0.025


def drop_caches(artifact: Path | None = None) -> None:
    """Empty the page cache (root), or with `artifact` drop only that folder's files from it (posix_fadvise
    DONTNEED: no root needed; the libraries the start imports stay cached, as on a node whose image is warm)."""
    os.sync()
    if artifact is None:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return
    for f in artifact.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def disk_read_rate(path: Path, readers: int = 1) -> float:
    """Bytes per second of reading `path` once (call right after drop_caches): one reader in order in 16 MiB reads,
    or `readers` threads each taking the next 32 MiB piece in turn (how kiln serve's checks read an uncached file)."""
    import itertools
    from concurrent.futures import ThreadPoolExecutor

    size, piece, claim = path.stat().st_size, (16 if readers == 1 else 32) << 20, itertools.count()
    fd = os.open(path, os.O_RDONLY)

    def read() -> int:
        buf, n = bytearray(piece), 0
        while (i := next(claim)) * piece < size:
            n += os.preadv(fd, [buf], i * piece)
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        n = sum(pool.map(lambda _: read(), range(readers)))
    os.close(fd)
    return n / (time.perf_counter() - t0)


def measure_disk(path: Path, artifact: Path | None) -> dict:
    """The disk's read rate of `path`, uncached (drop_caches(artifact)), by one reader and by 8 (bytes per second)."""
    out = {}
    for readers in (1, 8):
        drop_caches(artifact)
        out[readers] = disk_read_rate(path, readers)
    return out


def process_read_bytes(pid: int) -> int | None:
    """Bytes the process has had read from storage so far (/proc/PID/io read_bytes: its page-cache misses)."""
    try:
        return int(re.search(r"read_bytes: (\d+)", Path(f"/proc/{pid}/io").read_text()).group(1))
    except (OSError, AttributeError):
        return None


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) the process has used so far (Linux /proc): a figure that a machine
    busy with other work inflates far less than the wall time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _complete(base: str, prompt: str | None) -> float:
    """Seconds for a one-token completion (its time to first token); prompt None: a request the server refuses at
    once (400), which warms the client's side only."""
    body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0} if prompt else {}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
    except urllib.error.HTTPError:
        if prompt is not None:
            raise
    return time.perf_counter() - t0


def one_start(
    artifact: str, requests: int, extra: list[str], idle: float = 0.0, tree: str | None = None, envs: str = ""
) -> dict:
    """Start `kiln serve artifact` on a free port (with `tree` first on PYTHONPATH, `envs`' K=V pairs set), time it to
    /health 200, read its phases, send `requests` one-token completions, stop it."""
    source = [] if artifact == "-" else [artifact]  # "-": plain `kiln serve`, the embedded model
    cmd = [sys.executable, "-m", "kiln.serving.cli", "serve", *source, "--port", "0", "--no-access-log", *extra]
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in envs.split())) if envs.strip() else None
    if tree is not None:
        env = env or dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
        if not source:  # each tree's code fingerprint differs: its own artifacts/ (ensure_artifact)
            env["KILN_ARTIFACTS"] = os.path.join(tree, "artifacts")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    port: list[int] = []

    def read() -> None:
        for line in proc.stderr:
            lines.append(line.rstrip())
            if not port and (m := re.search(r"http://[\d.]+:(\d+)", line)):
                port.append(int(m.group(1)))

    threading.Thread(target=read, daemon=True).start()
    result: dict = {}
    try:
        while not port:
            if proc.poll() is not None or time.perf_counter() - t0 > 600:
                raise RuntimeError("kiln serve did not start:\n" + "\n".join(lines[-20:]))
            time.sleep(0.005)
        base = f"http://127.0.0.1:{port[0]}"
        polls = 1
        while _get(f"{base}/health") != 200:
            if proc.poll() is not None or time.perf_counter() - t0 > 600:
                raise RuntimeError("kiln serve never became ready:\n" + "\n".join(lines[-20:]))
            time.sleep(POLL_S)
            polls += 1
        result["health_200"] = time.perf_counter() - t0
        result["polls"] = polls  # each one the server answers costs it ~1 ms of CPU (2-core machine): part of cpu_200
        result["cpu_200"] = process_cpu(proc.pid)
        if (read := process_read_bytes(proc.pid)) is not None:
            result["read_gb"] = read / 1e9  # from storage until ready: the weights and what else the start read
        time.sleep(0.05)  # the ready line is logged right after the engine is attached
        ready = next((x for x in lines if "(ready)" in x), "")
        result.update({k: float(v) for k, v in re.findall(r"\b(\w+) (\d+\.\d+)", ready) if k in PHASES})
        if m := re.search(r"([\d.]+) MB of weights", ready):
            result["weight_gb"] = float(m.group(1)) / 1e3
        _complete(base, None)  # the client's own first POST (urllib's set-up) is not the server's
        # each prompt starts with two words of its own that every tokenizer here gives ids of their own (a word-level
        # test vocabulary "t0".."tN" too, whose other words are all its unknown id): were the first page's ids the
        # same, the prefix cache would serve requests 2..N their prompt and only request 1 would compute it
        words = "the quick brown fox jumps over the lazy dog while the server answers every request"
        prompts = [f"t{100 + i % 100} t{200 + i // 100 % 50} {words}" for i in range(requests)]
        result["ttft"] = [_complete(base, prompt) for prompt in prompts]
        until = time.perf_counter() + idle
        while idle and time.perf_counter() < until and not any("every program loaded" in x for x in lines):
            time.sleep(0.1)
        if m := re.search(r"every program loaded \(\d+ deferred, the last ([\d.]+) s", "\n".join(lines)):
            result["all_programs_s"] = float(m.group(1))
    finally:
        result["log"] = [x for x in lines if "kiln" in x and "DEBUG" not in x][-20:]
        result["log"] += [x for x in lines if "tensors uploaded" in x]  # `-- --log-level debug`: the uploads' seconds
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("-n", type=int, default=5, help="fresh processes (default 5)")
    p.add_argument("--requests", type=int, default=10, help="one-token completions after ready (default 10)")
    p.add_argument(
        "--drop-caches",
        nargs="?",
        const="all",
        choices=("all", "artifact"),
        default=None,
        help="before every start empty the page cache (all, root) or drop the artifact's files only",
    )
    p.add_argument("--json", default=None, help="write every run's figures here")
    p.add_argument("--idle", type=float, default=0.0, help="seconds to wait for deferred programs after the requests")
    p.add_argument("--trees", default=None, help="A,B: alternate starts of two kiln trees (see above)")
    p.add_argument("--envs", default=None, help="K=V K2=V2,K=W: alternate starts of environment variants (see above)")
    p.add_argument("serve_args", nargs="*", help="more `kiln serve` arguments (after --)")
    args = p.parse_args()
    if args.trees and args.envs:
        p.error("give --trees or --envs, not both")
    variants = args.trees or args.envs
    trees = variants.split(",") if variants else [None]
    runs: dict = {t: [] for t in trees}
    disk = []
    if args.artifact == "-":  # one start per tree first, not counted: it compiles the tree's artifact if it must
        for tree in trees if args.trees else [None]:
            one_start(args.artifact, 0, args.serve_args, 0.0, tree)
    weights_bin = Path(args.artifact) / "weights" / "weights.bin"
    only = Path(args.artifact) if args.drop_caches == "artifact" else None
    if args.drop_caches:  # the disk's rate before the starts and after them: it moved 12% within minutes (round 10)
        disk.append(measure_disk(weights_bin, only))
    for i in range(args.n):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            if args.drop_caches:
                drop_caches(only)
            load = os.getloadavg()[0]
            where = (tree, "") if args.trees else (None, tree or "")
            runs[tree].append(one_start(args.artifact, args.requests, args.serve_args, args.idle, *where))
            runs[tree][-1]["loadavg"] = load
            print(f"start {i + 1}{f' of {tree}' if tree else ''}: /health 200 after "
                  f"{runs[tree][-1]['health_200']:.2f} s (load average {load:.1f})", flush=True)  # fmt: skip
    if args.drop_caches:
        disk.append(measure_disk(weights_bin, only))
    print(f"\n{' '.join(sys.argv)}")
    for tree in trees:
        report(runs[tree], args, disk, tree)
    if args.json:
        out = runs[None] if variants is None else runs
        Path(args.json).write_text(json.dumps({"runs": out, "disk_bytes_per_s": disk}, indent=1))


def report(runs: list[dict], args: argparse.Namespace, disk: list[dict], tree: str | None) -> None:
    """The medians of one tree's starts."""

    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return statistics.median(values) if values else None

    print(f"{len(runs)} starts of {args.artifact}{f' with {tree}' if tree else ''}, medians (s):")
    print("| phase | seconds |\n|---|---|")
    for key in (*PHASES, "health_200", "cpu_200", "read_gb", "polls", "all_programs_s", "loadavg"):
        if (v := med(key)) is not None:
            print(f"| {key} | {v:.2f} |")
    gb = med("weight_gb")
    if gb and med("load"):
        print(f"weights: {gb:.2f} GB read; {gb / med('load'):.2f} GB/s over the whole load phase")
    if disk:
        start = med("health_200")
        rates = {readers: statistics.mean(d[readers] for d in disk) / 1e9 for readers in (1, 8)}  # GB/s, their means
        for readers, rate in rates.items():
            each = " and ".join(f"{d[readers] / 1e9:.2f}" for d in disk)
            print(
                f"disk, {readers} reader(s): {each} GB/s reading weights.bin (uncached, before and after the "
                f"starts); the weights in {gb / rate:.2f} s at their mean, the median start {start * rate / gb:.2f}x"
            )
        fastest = max(rates.values())
        print(f"floor (the faster): {gb / fastest:.2f} s, the median start {start * fastest / gb:.2f}x it")
        if (read := med("read_gb")) is not None:
            print(
                f"everything the start read from storage, {read:.2f} GB, at the faster rate: {read / fastest:.2f} s, "
                f"the median start {start * fastest / read:.2f}x it"
            )
    if args.requests >= 2:
        first = statistics.median(r["ttft"][0] for r in runs)
        last = statistics.median(r["ttft"][-1] for r in runs)
        rest = statistics.median(statistics.median(r["ttft"][1:]) for r in runs)
        print(f"one-token completion after ready: request 1 {first * 1e3:.0f} ms, request {args.requests} "
              f"{last * 1e3:.0f} ms, ratio {first / last:.2f} (median of requests 2-{args.requests}: "
              f"{rest * 1e3:.0f} ms, ratio {first / rest:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
