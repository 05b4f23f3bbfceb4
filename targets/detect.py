"""What this machine has: the local jax devices, and the built-in target that fits them (`auto`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from kiln.targets.target import BUILTIN, Target


@dataclass(frozen=True)
class LocalDevices:
    """The devices jax sees here (its default backend)."""

    platform: str  # cpu | cuda | rocm | tpu
    device_kind: str
    device_count: int
    memory_bytes: int | None  # per device, where the runtime reports it


def local_devices() -> LocalDevices:
    devices = jax.devices()
    d = devices[0]
    platform = d.platform
    if platform == "gpu":
        platform = "rocm" if "rocm" in d.client.platform_version.lower() else "cuda"
    memory = None
    try:
        stats = d.memory_stats() or {}
        memory = stats.get("bytes_limit")
    except Exception:  # not every runtime reports memory (CPU does not)
        memory = None
    if memory is None and platform == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return LocalDevices(platform=platform, device_kind=d.device_kind, device_count=len(devices), memory_bytes=memory)


def detect_target() -> Target:
    """The built-in target for this machine's devices: a TPU slice by generation and chip count, cuda, rocm or cpu.

    GPU targets get the detected device kind and count; the CPU target counts the host devices jax sees.
    """
    here = local_devices()
    if here.platform == "tpu":
        for t in BUILTIN.values():
            if t.platform == "tpu" and t.device_kind == here.device_kind and t.device_count == here.device_count:
                return t
        base = next((t for t in BUILTIN.values() if t.device_kind == here.device_kind), BUILTIN["tpu-v5e-1"])
        return base.replace(
            name=f"tpu-{here.device_count}",
            device_kind=here.device_kind,
            device_count=here.device_count,
            topology=None,
            device_memory_bytes=here.memory_bytes or base.device_memory_bytes,
        )
    target = BUILTIN[here.platform] if here.platform in BUILTIN else BUILTIN["cpu"]
    if here.platform in ("cuda", "rocm"):
        target = target.replace(device_kind=here.device_kind, device_count=here.device_count)
    else:
        target = target.replace(device_count=here.device_count)
    return target
