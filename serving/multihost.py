"""Multi-host serving through JAX's multi-controller runtime (jax.distributed): one artifact served by every host of a
slice, process 0 running HTTP and the scheduler.

Every process runs `kiln serve ARTIFACT` with the same artifact: on a TPU VM slice with no options beyond --multihost
(jax.distributed.initialize() reads the slice from the VM's environment), elsewhere with --coordinator HOST:PORT
--num-processes N --process-id I. After initialize, jax.devices() are the devices of every process; the artifact's
programs (compiled for the whole slice's mesh) are compiled at load for the global devices, and every process holds
its own shards of the weights and the KV cache.

Per step, process 0 (the leader) announces the step before running it: a small header (bucket, step or decode,
which sampling rows are the device-resident neutral ones) through the coordination service's key-value store, then
the step's inputs (Batch and SamplingBatch, numpy) through one jax.experimental.multihost_utils.broadcast_one_to_all.
Every other process (a follower) waits for the header, receives the inputs and calls the same program on its shards;
XLA's collectives inside the program (the tensor-parallel all-reduces) join them. The sampled tokens are replicated,
so the leader reads them from its own devices.

Failure: each process beats a counter in the key-value store every HEARTBEAT s and watches the others'. A process
whose counter stops for STALE s, a coordinator that stops answering, or a step that raises ends every process with one
sentence on stderr and exit status 1 (JAX's own heartbeat, set to JAX_HEARTBEAT s, is the backstop). When the leader
stops normally it says so in the store and the followers exit 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from kiln.models.batch import Batch
from kiln.models.errors import KilnError
from kiln.models.sampling import SamplingBatch

log = logging.getLogger("kiln.multihost")

HEARTBEAT = 0.5  # seconds between beats
STALE = 5.0  # a process whose beat has not moved for this long is gone (so is one holding the GIL that long)
JAX_HEARTBEAT = 30  # jax.distributed's own heartbeat timeout (the backstop): it may fire from about half of it after
#                     a process dies, so it must stay well above STALE or it aborts the process before kiln says why
IDLE = ("history", "allowed")  # sampling fields the runner may pass as device-resident neutral rows
_KEY = "kiln/"


def requested(coordinator: str | None, num_processes: int | None, process_id: int | None, auto: bool) -> bool:
    """Whether the serve options ask for multi-host mode; a partial set of the three explicit options is an error."""
    given = [x is not None for x in (coordinator, num_processes, process_id)]
    if any(given) and not all(given):
        raise KilnError("Multi-host serving needs all of --coordinator, --num-processes and --process-id (or none).")
    if all(given) and not (num_processes >= 1 and 0 <= process_id < num_processes):
        raise KilnError(f"--process-id must be in [0, {num_processes}) and --num-processes positive.")
    return auto or all(given)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> None:
    """Join the slice: jax.distributed.initialize (explicit, or from a TPU VM's environment when all are None), CPU
    collectives through gloo, then the heartbeat watchdog. Must run before anything touches a device."""
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator, num_processes, process_id, heartbeat_timeout_seconds=JAX_HEARTBEAT, initialization_timeout=120
        )
    except Exception as e:  # jax raises several types for an unreachable coordinator or a bad environment
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KilnError(f"Joining the multi-host slice failed ({first[:200]}).") from None
    Watchdog(jax.process_index(), jax.process_count()).start()
    log.info("process %d of %d; %d local of %d devices", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())  # fmt: skip


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def die(sentence: str, status: int = 1) -> None:
    """End this process at once with one sentence on stderr (threads blocked in XLA cannot be joined)."""
    sys.stderr.write(f"kiln: {sentence}\n")
    sys.stderr.flush()
    os._exit(status)


class Watchdog(threading.Thread):
    """Beats this process's counter in the key-value store and ends the process when another's stops moving, when
    the coordinator stops answering, or (a follower) when the leader says it stopped."""

    def __init__(self, index: int, count: int):
        super().__init__(name="kiln-multihost-watchdog", daemon=True)
        self.index, self.count = index, count
        self.last_ok = time.monotonic()

    def run(self) -> None:
        threading.Thread(target=self._guard, name="kiln-multihost-guard", daemon=True).start()
        client, beat = _client(), 0
        seen = {p: (None, time.monotonic()) for p in range(self.count) if p != self.index}
        while True:
            beat += 1
            try:
                client.key_value_set(f"{_KEY}beat/{self.index}", str(beat), allow_overwrite=True)
                if self.index != 0 and _try_get(client, f"{_KEY}stop") is not None:
                    die(f"process 0 stopped serving; process {self.index} exits.", 0)
                now = time.monotonic()
                for p, (value, since) in seen.items():
                    current = _try_get(client, f"{_KEY}beat/{p}")
                    if current != value:
                        seen[p] = (current, now)
                    elif value is not None and now - since > STALE:
                        die(f"process {p} of {self.count} stopped answering (no heartbeat for {STALE:.0f} s); "
                            f"stopping process {self.index}.")  # fmt: skip
            except Exception as e:
                first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
                die(f"lost the multi-host coordinator ({first}); stopping process {self.index}.")
            self.last_ok = time.monotonic()
            time.sleep(HEARTBEAT)

    def _guard(self) -> None:
        """A key-value call that hangs (the coordinator's host gone without a reset) ends the process too."""
        while True:
            time.sleep(HEARTBEAT)
            if time.monotonic() - self.last_ok > STALE:
                die(f"the multi-host coordinator has not answered for {STALE:.0f} s; stopping process {self.index}.")


def _try_get(client, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception as e:
        if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
            return None
        raise


def stop() -> None:
    """The leader's normal shutdown: tell the followers to exit."""
    if jax.process_count() > 1 and jax.process_index() == 0:
        try:
            _client().key_value_set(f"{_KEY}stop", "1", allow_overwrite=True)
        except Exception:  # already gone: the followers' watchdogs stop them
            pass


def _templates(num_tokens: int, num_seqs: int, max_pages: int, vocab: int, idle: tuple[str, ...]):
    """Zero numpy inputs of a bucket, the idle sampling fields left out (None)."""
    zeros = lambda a: np.zeros(a.shape, a.dtype)  # noqa: E731
    batch = jax.tree.map(zeros, Batch.abstract(num_tokens, num_seqs, max_pages))
    sampling = jax.tree.map(zeros, SamplingBatch.abstract(num_seqs, vocab))
    return batch, dataclasses.replace(sampling, **{f: None for f in idle})


def _broadcast(tree):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=jax.process_index() == 0)


class _Neutral(np.ndarray):
    """A sampling field's neutral rows (the runner's idle rows): the followers make their own, nothing is sent."""


class Leader:
    """Process 0's side: wraps a Runner's programs so each call is announced to the followers first."""

    def __init__(self, runner):
        self.runner = runner
        self.seq = 0
        self.lock = threading.Lock()  # announcements and calls in one order
        runner.programs = {t: self._wrap(p, t, False) for t, p in runner.programs.items()}
        runner.decode = {t: self._wrap(p, t, True) for t, p in runner.decode.items()}
        # the runner keeps neutral rows on the device (a device_put onto every process's devices, which would wait
        # for the followers); here they stay numpy, marked, and each process passes its own
        runner.idle_rows = lambda field, rows: rows.view(_Neutral)

    def _wrap(self, program: Callable, bucket: int, decode: bool) -> Callable:
        def call(weights, kv, batch, sampling):
            with self.lock:
                try:
                    self._announce(bucket, decode, batch, sampling)
                    out, kv = program(weights, kv, batch, sampling)
                except Exception as e:
                    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                    die(f"a multi-host step failed on process 0 ({first}); stopping every process.")
            # the sampled tokens are replicated: read them from this process's first device (still asynchronous)
            return jax.tree.map(lambda a: a.addressable_shards[0].data, out), kv

        return call

    def _announce(self, bucket: int, decode: bool, batch, sampling) -> None:
        idle = tuple(f for f in IDLE if isinstance(getattr(sampling, f), _Neutral))
        header = {"bucket": bucket, "decode": decode, "seqs": int(batch.seq_lens.shape[0]), "idle": idle}
        client = _client()
        client.key_value_set(f"{_KEY}step/{self.seq}", json.dumps(header))
        if self.seq >= 2:  # followers have read it: they are in the broadcast of step seq - 1 at least
            client.key_value_delete(f"{_KEY}step/{self.seq - 2}")
        self.seq += 1
        _broadcast((batch, dataclasses.replace(sampling, **{f: None for f in idle})))


def lead(runner) -> Leader | None:
    """Make a Runner announce its steps when this is process 0 of several (None otherwise)."""
    return Leader(runner) if jax.process_count() > 1 and jax.process_index() == 0 else None


def follow(path: str) -> int:
    """A follower's whole life: load the artifact, then run every step the leader announces, until the leader stops
    (the watchdog ends the process) or a step fails (one sentence, status 1)."""
    from kiln.compile import artifact

    index = jax.process_index()
    art = artifact.load(path)
    if not any(d.process_index == index for d in art.mesh.devices.flat):
        die(
            f"process {index} holds none of the artifact's {art.mesh.devices.size} devices (tp={art.geometry.tp}); "
            f"compile it with --tp equal to the slice's {jax.device_count()} devices to serve it from every host."
        )
    kv = art.make_kv()
    client, seq = _client(), 0
    vocab = art.cfg.vocab_size
    log.info("process %d ready: following process 0's steps", index)
    while True:
        try:
            header = json.loads(client.blocking_key_value_get(f"{_KEY}step/{seq}", 24 * 3600 * 1000))
        except Exception as e:
            first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            die(f"lost the multi-host coordinator while waiting for a step ({first}); stopping process {index}.")
        seq += 1
        t, idle, seqs = header["bucket"], tuple(header["idle"]), header["seqs"]
        try:
            batch, sampling = _broadcast(_templates(t, seqs, art.max_pages_per_seq, vocab, idle))
            neutral = SamplingBatch.neutral(seqs, vocab_size=vocab)
            sampling = dataclasses.replace(sampling, **{f: getattr(neutral, f) for f in idle})
            program = art.decode_programs[t] if header["decode"] else art.programs[t]
            out, kv = program(art.weights, kv, batch, sampling)
            del out
        except Exception as e:
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            die(f"a multi-host step failed on process {index} ({first}); stopping every process.")
