"""The artifact's weights as one flat file that is memory-mapped at load: no parse, no extra host copy.

    <artifact>/weights/weights.bin    every tensor of the flat weight dict (kiln.compile.convert.to_flat names), in
                                      name order, each at a multiple of ALIGN bytes, row-major in its stored dtype
                                      (int4: two values a byte, the first in the low nibble)

The manifest's "weights" entry (`save`'s result) lists each tensor's offset, shape and dtype and the sha256 of every
CHUNK bytes of the file, so the file is verified in parallel, chunk by chunk, while it is being placed on the devices
instead of in a separate pass. On a CPU an aligned mapped tensor becomes a jax array without a copy (XLA reads the
page cache directly); on an accelerator each tensor's shards are uploaded from the mapping, several tensors at once.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kiln.models.errors import KilnError

log = logging.getLogger("kiln.compile")

FILE = "weights/weights.bin"
ALIGN = 4096  # every tensor starts on a page: zero-copy on CPU needs 64-byte alignment, page-aligned reads are cheap
CHUNK = 32 << 20  # bytes per sha256 (chunks verify in parallel)


def _packed(a: np.ndarray) -> np.ndarray:
    """Bytes of `a` as stored: int4 two values a byte (low nibble first), everything else as it is in memory."""
    if a.dtype == ml_dtypes.int4:
        v = a.reshape(-1).view(np.int8).astype(np.uint8) & 0x0F  # (n,) the two's-complement nibbles
        if v.size % 2:
            v = np.append(v, np.uint8(0))
        return v[0::2] | (v[1::2] << 4)  # (ceil(n / 2),)
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _unpacked(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The int4 tensor of `shape` from its packed bytes (a copy: numpy holds int4 one value a byte)."""
    n = int(np.prod(shape))
    pairs = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(-1)[:n].astype(np.int8)  # (n,) nibbles 0..15
    return ((pairs ^ 8) - 8).astype(ml_dtypes.int4).reshape(shape)  # sign-extended


def _tensor(raw: np.ndarray, t: dict) -> np.ndarray:
    """The tensor the manifest entry `t` describes, from its stored bytes `raw` (a view; a copy for int4)."""
    shape = tuple(t["shape"])
    if t["dtype"] == "int4":
        return _unpacked(raw, shape)
    return raw.view(jnp.dtype(t["dtype"])).reshape(shape)


def save(folder: Path, flat: dict[str, np.ndarray]) -> dict:
    """Write every tensor of `flat` into folder/weights/weights.bin; returns the manifest's description of it
    (file, bytes, tensors {name: offset, shape, dtype}, chunk_bytes, chunks: sha256 of each CHUNK bytes)."""
    path = folder / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, offset = {}, 0
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for name in sorted(flat):
            a = np.asarray(flat[name])
            data = _packed(a)
            pad = -offset % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            tensors[name] = {"offset": offset, "shape": list(a.shape), "dtype": str(a.dtype), "bytes": int(data.size)}
            f.write(memoryview(data))  # no copy of the tensor
            offset += data.size
    os.replace(tmp, path)

    def digest(i: int) -> str:
        with open(path, "rb") as f:
            f.seek(i * CHUNK)
            return hashlib.sha256(f.read(CHUNK)).hexdigest()

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        chunks = list(pool.map(digest, range(-(-offset // CHUNK))))
    return {"file": FILE, "file_bytes": offset, "tensors": tensors, "chunk_bytes": CHUNK, "chunks": chunks}


class MappedWeights:
    """weights.bin mapped read-only: numpy views of every tensor, and the chunk checks of the file."""

    def __init__(self, folder: Path, meta: dict):
        path = folder / meta["file"]
        if not path.is_file():
            raise KilnError(f"The artifact file {meta['file']} is missing from {folder}; recompile it.")
        size = path.stat().st_size
        if size != meta["file_bytes"]:
            raise KilnError(
                f"The artifact file {path} has {size} bytes where its manifest says {meta['file_bytes']} (edited or "
                f"truncated); recompile it with `kiln compile`."
            )
        self.path, self.meta = path, meta
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if size else b""
        if size:
            self.map.madvise(mmap.MADV_WILLNEED)  # the kernel reads ahead the whole file (an uncached start)
        self.buf = np.frombuffer(self.map, np.uint8) if size else np.zeros(0, np.uint8)

    def stored(self, name: str) -> np.ndarray:
        """The bytes of tensor `name` in the file (uint8, a view of the mapping)."""
        t = self.meta["tensors"][name]
        return self.buf[t["offset"] : t["offset"] + t["bytes"]]

    def array(self, name: str) -> np.ndarray:
        """The tensor `name` as stored: a view of the mapping (a copy for int4, which numpy holds a byte a value)."""
        return _tensor(self.stored(name), self.meta["tensors"][name])

    def check_chunk(self, i: int) -> None:
        """Raise a one-sentence KilnError unless chunk i of the file has its manifest sha256 (hashlib releases the
        GIL, so chunks check in parallel on a thread pool)."""
        step = self.meta["chunk_bytes"]
        self.verify(i, memoryview(self.map)[i * step : (i + 1) * step])  # a view: slicing the mmap itself would copy

    def verify(self, i: int, data) -> None:
        """Raise a one-sentence KilnError unless `data` (the bytes of chunk i, from wherever they were read) has
        chunk i's manifest sha256."""
        step = self.meta["chunk_bytes"]
        if hashlib.sha256(data).hexdigest() != self.meta["chunks"][i]:
            raise KilnError(
                f"The artifact file {self.path} does not match its sha256 in manifest.json at bytes "
                f"{i * step}-{min((i + 1) * step, len(self.buf))} (edited or damaged); "
                f"recompile it with `kiln compile`."
            )

    def chunks_of(self, name: str) -> range:
        """The indices of the CHUNK-byte chunks that hold tensor `name`."""
        t, step = self.meta["tensors"][name], self.meta["chunk_bytes"]
        return range(t["offset"] // step, (t["offset"] + max(t["bytes"], 1) - 1) // step + 1)

    def checks(self, pool: Executor) -> list[Future]:
        return [pool.submit(self.check_chunk, i) for i in range(len(self.meta["chunks"]))]


def expect_tensors(mapped: MappedWeights, abstract: dict[str, jax.ShapeDtypeStruct]) -> None:
    """Raise a one-sentence KilnError unless the file holds exactly the tensors the model config and weight format
    call for, with their shapes and dtypes."""
    stored = mapped.meta["tensors"]
    if set(stored) != set(abstract):
        odd = sorted(set(stored) ^ set(abstract))[:3]
        raise KilnError(f"The artifact's weights do not fit its model config (tensors {', '.join(odd)} differ); "
                        f"recompile it with `kiln compile`.")  # fmt: skip
    for name, want in abstract.items():
        got = stored[name]
        if tuple(got["shape"]) != tuple(want.shape) or got["dtype"] != str(jnp.dtype(want.dtype)):
            raise KilnError(
                f"The artifact's weight {name} is {got['dtype']}{got['shape']} but its model config calls for "
                f"{jnp.dtype(want.dtype)}{list(want.shape)}; recompile it with `kiln compile`."
            )


UPLOADS = ("pieces", "pinned", "sync", "direct")
PIECE = 64 << 20  # bytes of each "pieces" transfer (row blocks of a larger tensor, joined on the device)
JOINABLE = tuple(np.dtype(t) for t in (np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.uint8, np.int32))


def upload_mode() -> str:
    """How an accelerator's weights leave the host (env KILN_UPLOAD). Every mode but "direct" waits for each transfer,
    so the page-locked memory the transfers pass through stays a few tensors' worth. On an H200 (16 GB, every chunk
    checked, a fresh process: benchmarks/h2d_upload.py) the first uploads took pinned 3.4 s, sync 4.0, direct 9.2
    (BENCHMARKS.md, issue 15, round 4; two more modes, a registered buffer per thread and pread into a reused one,
    measured no faster in rounds 4, 5 and 9 and were removed in session 14):

    * "pieces" (default): device_put of the mapped bytes in transfers of at most PIECE bytes, each waited for (a larger
      tensor's row blocks, joined on the device by one concatenation: a program compiled at the load, once per
      shape). PJRT's rate depends on the size of a transfer: 16 GB of a mapped file in 64 MB pieces from 8 threads
      went up at 16.4 GB/s in a fresh process, in 256 MB pieces at 10.4, in 1 GB pieces at 6.6 (h2d_first_touch,
      BENCHMARKS.md, issue 15, round 10); an 8B model's tensors are 1-1050 MB. Warm 8B starts alternated with
      "pinned" on one H200: 4.19 s against 5.09 (medians of 5), weights phase 2.05 s against 2.77;
    * "pinned": a page-locked copy of each tensor (memory kind pinned_host), then to the devices;
    * "sync": device_put of the mapped (pageable) bytes (PJRT stages them in pinned memory of its own);
    * "direct": device_put of the mapped bytes without waiting: PJRT's pinned staging grows with the transfers in
      flight (to the whole 16 GB), which a process pays on first use.
    """
    mode = os.environ.get("KILN_UPLOAD", "pieces")
    if mode not in UPLOADS:
        raise KilnError(f"KILN_UPLOAD={mode!r} is not an upload mode; choose one of {', '.join(UPLOADS)}.")
    return mode


def upload_threads(mode: str) -> int:
    """Upload threads (each mostly waits for a transfer or copies memory)."""
    return max(1, min(16, (os.cpu_count() or 1) // 2))


def check_threads() -> int:
    """Threads for the sha256 checks (hashlib releases the GIL): half the cores, at most 16. On an H200 (16 cores)
    12 instead of 8 did not pay: the uploads hardly wait for the checks (0.8 thread-seconds of 28 in the default
    mode's first pass) and a warm start's checks ended later (2.2 s against 1.7; BENCHMARKS.md, issue 15, round 5)."""
    return max(1, min(16, (os.cpu_count() or 1) // 2))


def on_accelerator(sharding: jax.sharding.Sharding) -> bool:
    return next(iter(sharding.device_set)).platform != "cpu"


def place(mapped: MappedWeights, name: str, want: jax.ShapeDtypeStruct, upload: str = "direct") -> jax.Array:
    """The tensor `name` on the devices of want.sharding. A single CPU device takes the mapped bytes without a copy;
    an accelerator gets every device's shard as `upload` says (an int4 tensor as its stored bytes: `_place_int4`)."""
    sharding = want.sharding
    accelerator = on_accelerator(sharding)
    if accelerator and want.dtype == jnp.int4 and len(want.shape) and sharding.shard_shape(want.shape)[-1] % 2 == 0:
        return _place_int4(mapped, name, want, upload)
    return _upload(mapped.array(name), sharding, upload, accelerator)


def _place_int4(mapped: MappedWeights, name: str, want: jax.ShapeDtypeStruct, upload: str) -> jax.Array:
    """An int4 tensor on an accelerator: its stored bytes (two values each: half of numpy's int4, which holds a byte a
    value, and nothing to unpack on the host) go up as uint8 (..., last / 2), and the devices read them as the int4
    (..., last) (a bitcast). Unpacking on the host costs 1.4 ns a value (an 8B model's ~8 G values: ~11 CPU seconds),
    and an 8B model's int4 weights took twice bf16's time to load on an H200 (6.3 against 3.1 s, for a quarter of the
    bytes). The tensor's first row is compared with the host's unpacking of its bytes: should a platform order the
    nibbles otherwise, or lack the bitcast, the tensor takes the host's path."""
    shape = tuple(want.shape)
    raw = mapped.stored(name).reshape(*shape[:-1], shape[-1] // 2)
    head = (0,) * (len(shape) - 1)
    try:
        packed = _upload(raw, want.sharding, upload, True)
        out, first = _int4_of_bytes(packed)
        out = jax.device_put(out, want.sharding)
        packed.delete()
        same = np.array_equal(np.asarray(first).astype(np.int8), _unpacked(raw[head], shape[-1:]).astype(np.int8))
    except Exception:  # noqa: BLE001 (a platform without the bitcast: the host's path raises any real error again)
        out, same = None, False
    if same:
        return out
    if out is not None:
        out.delete()
    log.warning("%s: int4 bytes not read back as int4 on %s; unpacked on the host instead", name, want.sharding)
    return _upload(mapped.array(name), want.sharding, upload, True)


@jax.jit
def _int4_of_bytes(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 (..., n) -> int4 (..., 2n), each byte's low nibble first as the file stores them, and its first row (one
    program per shape, compiled at the load)."""
    out = jax.lax.bitcast_convert_type(packed, jnp.int4).reshape(*packed.shape[:-1], -1)
    return out, out[(0,) * (out.ndim - 1)]


def _upload(host: np.ndarray, sharding: jax.sharding.Sharding, upload: str, accelerator: bool) -> jax.Array:
    if upload == "pinned" and accelerator:
        return staged_upload(host, sharding)
    if upload == "pieces":  # on a CPU device too (tests); kiln's load uploads there with "direct"
        return pieces_upload(host, sharding)
    out = _put(host, sharding)
    if upload == "sync" and accelerator:
        jax.block_until_ready(out)
    return out


def _put(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    if len(sharding.device_set) == 1:  # on a CPU without a copy; elsewhere one transfer
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def pieces_upload(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """host on the devices of sharding in transfers of at most PIECE bytes, each waited for: a larger tensor on one
    device as row blocks, joined there (any other tensor whole, and the narrow formats' int4 and fp8 tensors, whose
    concatenation no accelerator run has checked yet)."""
    n = -(-host.nbytes // PIECE)
    joinable = host.dtype in JOINABLE and host.ndim and host.shape[0] >= n
    if n <= 1 or not joinable or len(sharding.device_set) != 1:
        return jax.block_until_ready(_put(host, sharding))
    parts = [jax.block_until_ready(jax.device_put(block, sharding)) for block in np.array_split(host, n)]
    try:  # the join holds the tensor twice for a moment: where device memory is too tight for that, it goes up whole
        out = jax.block_until_ready(_join(*parts))
    except Exception:  # noqa: BLE001 (XLA's out-of-memory error; the whole upload raises what it raises)
        out = None
    for part in parts:
        part.delete()
    return out if out is not None else jax.block_until_ready(_put(host, sharding))


@jax.jit
def _join(*parts: jax.Array) -> jax.Array:
    return jnp.concatenate(parts)


def staged_upload(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """host on the devices of sharding through a page-locked copy (memory kind pinned_host), freed once the transfer
    to the devices' memory is done."""
    staged = jax.device_put(host, sharding.with_memory_kind("pinned_host"))
    out = jax.device_put(staged, sharding)
    out.block_until_ready()
    staged.delete()
    return out


class Uploads:
    """Puts a mapped weights file's tensors on an accelerator's devices, each tensor only once the bytes it is made of
    passed their sha256 (with verify).

    submit() queues one job per tensor on the upload pool, each waiting for the checks of its chunks (queued on the
    checks' pool, or `checked`: the futures of every chunk's check, started earlier), then `place`s it, and returns
    the jobs' futures ({name: jax.Array}) and the checks' futures. `seconds` adds up, over the threads, the time spent
    waiting for checks and transferring (benchmarks)."""

    def __init__(self, mapped: MappedWeights, mode: str, verify: bool = True):
        self.mapped, self.mode, self.verify = mapped, mode, verify
        self._lock = threading.Lock()  # the seconds
        self.seconds: dict[str, float] = {"wait": 0.0, "transfer": 0.0}

    def submit(self, wants: dict[str, jax.ShapeDtypeStruct], uploader: Executor, checker: Executor, checked=None):
        meta = self.mapped.meta
        names = sorted(wants, key=lambda n: meta["tensors"][n]["offset"])
        needed = sorted({i for n in names for i in self.mapped.chunks_of(n)}) if self.verify else []
        if checked is not None:  # every chunk's check, started earlier (kiln serve's prefetch)
            checks = {i: checked[i] for i in needed}
        else:
            checks = {i: checker.submit(self.mapped.check_chunk, i) for i in needed}

        def whole(name: str) -> dict[str, jax.Array]:
            t0 = time.perf_counter()
            for i in self.mapped.chunks_of(name) if checks else ():
                checks[i].result()  # no unchecked byte reaches a device
            t1 = time.perf_counter()
            out = {name: place(self.mapped, name, wants[name], self.mode)}
            self._add("wait", t1 - t0)
            self._add("transfer", time.perf_counter() - t1)
            return out

        jobs = [uploader.submit(whole, n) for n in names]
        return jobs, list(checks.values())

    def _add(self, key: str, seconds: float) -> None:
        with self._lock:
            self.seconds[key] += seconds
