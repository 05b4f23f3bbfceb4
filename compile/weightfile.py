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

import contextlib
import hashlib
import logging
import mmap
import os
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kiln.models.errors import KilnError

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
        self._local = threading.local()  # read(): each thread's buffer, reused tensor after tensor

    def array(self, name: str) -> np.ndarray:
        """The tensor `name` as stored: a view of the mapping (a copy for int4, which numpy holds a byte a value)."""
        t = self.meta["tensors"][name]
        return _tensor(self.buf[t["offset"] : t["offset"] + t["bytes"]], t)

    def read(self, name: str) -> np.ndarray:
        """The tensor `name` read (pread, no page faults on the mapping) into this thread's buffer, which the next
        read on this thread overwrites: use the result before reading again."""
        t = self.meta["tensors"][name]
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < t["bytes"]:
            buf = self._local.buf = np.empty(t["bytes"], np.uint8)
        raw, done = buf[: t["bytes"]], 0
        with open(self.path, "rb", buffering=0) as f:
            while done < raw.size:
                n = os.preadv(f.fileno(), [raw[done:]], t["offset"] + done)
                if n <= 0:
                    raise KilnError(f"The artifact file {self.path} ended early (truncated); recompile it.")
                done += n
        return _tensor(raw, t)

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


UPLOADS = ("pinned", "sync", "read", "dma", "direct")
SPAN = 256 << 20  # bytes a "dma" upload thread reads, checks and uploads at once (its registered buffer's size)

log = logging.getLogger("kiln.compile")


def upload_mode() -> str:
    """How an accelerator's weights leave the host (env KILN_UPLOAD). Every mode but "direct" waits for each transfer,
    so the page-locked memory the transfers pass through stays a few tensors' worth. On an H200 (16 GB, every chunk
    checked, a fresh process: benchmarks/h2d_upload.py) the first uploads took pinned 3.4 s, read 3.9, sync 4.0,
    dma 5.3, direct 9.2 (BENCHMARKS.md, issue 15):

    * "pinned" (default): a page-locked copy of each tensor (memory kind pinned_host), then to the devices;
    * "sync": device_put of the mapped (pageable) bytes (PJRT stages them in pinned memory of its own);
    * "read": pread into a buffer each thread reuses, then device_put;
    * "dma": each thread preads spans of whole chunks into one buffer of its own registered for DMA (`dma_map`),
      checks the chunks' sha256 there and uploads the span's tensors from it (the file is read once);
    * "direct": device_put of the mapped bytes without waiting: PJRT's pinned staging grows with the transfers in
      flight (to the whole 16 GB), which a process pays on first use.
    """
    mode = os.environ.get("KILN_UPLOAD", "pinned")
    if mode not in UPLOADS:
        raise KilnError(f"KILN_UPLOAD={mode!r} is not an upload mode; choose one of {', '.join(UPLOADS)}.")
    return mode


def upload_threads(mode: str) -> int:
    """Upload threads for `mode`: "dma" threads also hash what they read, so they get most cores."""
    cores = os.cpu_count() or 1
    return max(1, min(16, cores - 4 if mode == "dma" else cores // 2))


def place(mapped: MappedWeights, name: str, want: jax.ShapeDtypeStruct, upload: str = "direct") -> jax.Array:
    """The tensor `name` on the devices of want.sharding. A single CPU device takes the mapped bytes without a copy;
    an accelerator gets every device's shard as `upload` says (any mode but "dma", which goes by spans: Uploads)."""
    sharding = want.sharding
    accelerator = next(iter(sharding.device_set)).platform != "cpu"
    host = mapped.read(name) if upload == "read" and accelerator else mapped.array(name)
    if upload == "pinned" and accelerator:
        return staged_upload(host, sharding)
    out = _put(host, sharding)
    if upload in ("read", "sync") and accelerator:  # read: the buffer is reused, the transfer must be done first
        jax.block_until_ready(out)
    return out


def _put(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    if len(sharding.device_set) == 1:  # on a CPU without a copy; elsewhere one transfer
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


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

    submit() returns futures of {name: jax.Array} and the futures of the chunk checks it queued on the checks' pool.
    Mode "dma": jobs of whole chunks (`SPAN` bytes at most) on the upload pool, each read into its thread's
    registered buffer, checked there and uploaded from there (a tensor larger than a span is checked on the checks'
    pool and goes up from the mapping, waited for); other modes: one job per tensor, after its chunks' checks.
    close() unregisters the buffers once every job is done."""

    def __init__(self, mapped: MappedWeights, mode: str, verify: bool = True):
        self.mapped, self.mode, self.verify = mapped, mode, verify
        self._local = threading.local()
        self._buffers: list[tuple[int, object]] = []  # (address, registered client) of every registered buffer
        self._lock = threading.Lock()
        self._fd = os.open(mapped.path, os.O_RDONLY)

    def submit(self, wants: dict[str, jax.ShapeDtypeStruct], uploader: Executor, checker: Executor):
        meta, step = self.mapped.meta, self.mapped.meta["chunk_bytes"]
        names = sorted(wants, key=lambda n: meta["tensors"][n]["offset"])
        spans: list[tuple[int, int, list[str]]] = []  # (first chunk, end chunk, tensors) in file order
        big: list[str] = []
        if self.mode == "dma":
            most = max(1, SPAN // step)
            for n in names:
                c = self.mapped.chunks_of(n)
                if len(c) > most:
                    big.append(n)
                elif spans and c.stop - spans[-1][0] <= most:
                    spans[-1] = (spans[-1][0], max(spans[-1][1], c.stop), [*spans[-1][2], n])
                else:
                    spans.append((c.start, c.stop, [n]))
        else:
            big = names
        needed = sorted({i for n in big for i in self.mapped.chunks_of(n)}) if self.verify else []
        checks = {i: checker.submit(self.mapped.check_chunk, i) for i in needed}

        def whole(name: str) -> dict[str, jax.Array]:
            for i in self.mapped.chunks_of(name) if checks else ():
                checks[i].result()  # no unchecked byte reaches a device
            mode = "sync" if self.mode == "dma" else self.mode
            return {name: place(self.mapped, name, wants[name], mode)}

        jobs = [uploader.submit(whole, n) for n in big]
        jobs += [uploader.submit(self._span, lo, hi, ns, wants) for lo, hi, ns in spans]
        return jobs, list(checks.values())

    def _span(self, lo: int, hi: int, names: list[str], wants: dict) -> dict[str, jax.Array]:
        meta, step = self.mapped.meta, self.mapped.meta["chunk_bytes"]
        start, end = lo * step, min(hi * step, meta["file_bytes"])
        raw = self._buffer(next(iter(wants[names[0]].sharding.device_set)))[: end - start]
        done = 0
        while done < raw.size:
            n = os.preadv(self._fd, [raw[done:]], start + done)
            if n <= 0:
                raise KilnError(f"The artifact file {self.mapped.path} ended early (truncated); recompile it.")
            done += n
        for i in range(lo, hi) if self.verify else ():
            self.mapped.verify(i, raw[(i - lo) * step : (i - lo + 1) * step])  # the bytes that go up
        out = {}
        for n in names:
            t = meta["tensors"][n]
            host = _tensor(raw[t["offset"] - start : t["offset"] - start + t["bytes"]], t)
            if next(iter(wants[n].sharding.device_set)).platform == "cpu":
                host = host.copy()  # a CPU device would alias the buffer that the next span overwrites (tests)
            out[n] = _put(host, wants[n].sharding)
        return jax.block_until_ready(out)  # the buffer is this thread's next span's

    def _buffer(self, device) -> np.ndarray:
        """This thread's SPAN-byte buffer, registered for DMA with the device's client on first use (an unregistered
        one, staged by PJRT, where registering fails)."""
        buf = getattr(self._local, "buf", None)
        if buf is not None:
            return buf
        region = mmap.mmap(-1, SPAN)  # anonymous, page-aligned
        with contextlib.suppress(AttributeError, OSError):
            region.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to fault and pin
        buf = np.frombuffer(region, np.uint8)
        client = device.client
        try:
            client.dma_map(buf.ctypes.data, SPAN)
            with self._lock:
                self._buffers.append((buf.ctypes.data, client))
        except Exception as e:  # noqa: BLE001 (no dma_map here: PJRT stages the transfers itself)
            log.info("kiln: upload buffers not registered for DMA (%s: %s)", e.__class__.__name__, str(e)[:120])
        self._local.buf = buf
        return buf

    def close(self) -> None:
        """Unregister every buffer (call once every job is done) and close the file."""
        with self._lock:
            buffers, self._buffers = self._buffers, []
        for address, client in buffers:
            with contextlib.suppress(Exception):
                client.dma_unmap(address)
        self._local = threading.local()
        with contextlib.suppress(OSError):
            os.close(self._fd)
