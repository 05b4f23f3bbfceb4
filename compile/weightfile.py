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
        raw = self.buf[t["offset"] : t["offset"] + t["bytes"]]
        shape = tuple(t["shape"])
        if t["dtype"] == "int4":
            return _unpacked(raw, shape)
        return raw.view(jnp.dtype(t["dtype"])).reshape(shape)

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
        shape = tuple(t["shape"])
        if t["dtype"] == "int4":
            return _unpacked(raw, shape)
        return raw.view(jnp.dtype(t["dtype"])).reshape(shape)

    def check_chunk(self, i: int) -> None:
        """Raise a one-sentence KilnError unless chunk i of the file has its manifest sha256 (hashlib releases the
        GIL, so chunks check in parallel on a thread pool)."""
        step = self.meta["chunk_bytes"]
        chunk = memoryview(self.map)[i * step : (i + 1) * step]  # a view: slicing the mmap itself would copy
        if hashlib.sha256(chunk).hexdigest() != self.meta["chunks"][i]:
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


UPLOADS = ("direct", "pinned", "read")


def upload_mode() -> str:
    """How an accelerator's weights leave the host (env KILN_UPLOAD): "direct" hands the mapped (pageable) bytes to
    device_put; "pinned" copies each tensor into page-locked host memory and transfers it from there; "read" preads
    each tensor into a buffer its thread reuses (no page faults on the mapping) and transfers that."""
    mode = os.environ.get("KILN_UPLOAD", "direct")
    if mode not in UPLOADS:
        raise KilnError(f"KILN_UPLOAD={mode!r} is not an upload mode; choose one of {', '.join(UPLOADS)}.")
    return mode


def place(mapped: MappedWeights, name: str, want: jax.ShapeDtypeStruct, upload: str = "direct") -> jax.Array:
    """The tensor `name` on the devices of want.sharding. A single CPU device takes the mapped bytes without a copy;
    an accelerator gets every device's shard as upload_mode says."""
    sharding = want.sharding
    devices = sharding.device_set
    accelerator = next(iter(devices)).platform != "cpu"
    host = mapped.read(name) if upload == "read" and accelerator else mapped.array(name)
    if upload == "pinned" and accelerator:
        return staged_upload(host, sharding)
    if upload == "read" and accelerator:  # the buffer is reused: the transfer must be done before the next read
        return jax.block_until_ready(jax.make_array_from_callback(host.shape, sharding, lambda index: host[index]))
    if len(devices) == 1:  # on a CPU without a copy; elsewhere one transfer from the page cache
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
