"""Targets are data: the built-ins, their serialisation, `auto` on this machine, and `kiln targets`."""

from __future__ import annotations

import pytest

from kiln.models.errors import KilnError
from kiln.serving.cli import main
from kiln.targets.detect import detect_target
from kiln.targets.target import BUILTIN, Target, get_target, target_names

EXPECTED = {
    "cpu": ("cpu", "xla_cpu", "float32"),
    "cuda": ("cuda", "pallas_gpu", "bfloat16"),
    "rocm": ("rocm", "pallas_gpu", "bfloat16"),
    **{f"tpu-{g}-{n}": ("tpu", "pallas_tpu", "bfloat16") for g in ("v5e", "v6e") for n in (1, 4, 8, 16)},
}


def test_builtins():
    assert set(BUILTIN) == set(EXPECTED) and target_names()[-1] == "auto"
    for name, (platform, attention, dtype) in EXPECTED.items():
        t = get_target(name)
        assert (t.platform, t.attention, t.compute_dtype, t.kv_dtype) == (platform, attention, dtype, dtype)
        assert t.mesh_axes == ("tp",) and t.needs and t.token_buckets == tuple(sorted(t.token_buckets))
    for gen, kind in (("v5e", "TPU v5 lite"), ("v6e", "TPU v6 lite")):
        for n, topo in ((1, "1x1"), (4, "2x2"), (8, "2x4"), (16, "4x4")):  # 16: 4 hosts (multi-host)
            t = BUILTIN[f"tpu-{gen}-{n}"]
            assert (t.device_kind, t.device_count, t.topology) == (kind, n, f"{gen}:{topo}")


def test_round_trip_and_replace():
    for t in BUILTIN.values():
        assert Target.from_dict(t.to_dict()) == t
    debug = BUILTIN["tpu-v5e-4"].replace(attention="reference", xla_flags=("--xla_dump_to=/tmp/x",))
    assert debug.attention == "reference" and debug.env() == {"LIBTPU_INIT_ARGS": "--xla_dump_to=/tmp/x"}
    assert BUILTIN["cpu"].replace(xla_flags=("--a", "--b")).env() == {"XLA_FLAGS": "--a --b"}


def test_bad_targets():
    with pytest.raises(KilnError, match="Unknown target 'h100'; choose one of cpu, cuda, rocm, tpu-v5e-1"):
        get_target("h100")
    with pytest.raises(KilnError, match="unknown platform"):
        Target(name="x", platform="metal", description="", needs="")
    with pytest.raises(KilnError, match="increasing, distinct token buckets"):
        BUILTIN["cpu"].replace(token_buckets=(64, 16))


def test_auto_is_this_machine():
    t = detect_target()  # tests run with JAX_PLATFORMS=cpu
    assert t.platform == "cpu" and t.name == "cpu" and t.device_count >= 1
    assert get_target("auto") == t


def test_kiln_targets_lists_every_target(capsys):
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    for name in [*BUILTIN, "auto"]:
        assert f"\n{name} " in f"\n{out}"
    assert "needs: libtpu" in out and "what this machine has: cpu" in out


def test_an_artifact_of_a_changed_builtin_target_is_stale():
    import json

    from kiln.compile import _target_unchanged
    from kiln.targets.target import get_target

    cpu = get_target("cpu")
    as_stored = lambda t: json.loads(json.dumps(t.to_dict()))  # noqa: E731  (the manifest holds JSON)
    assert _target_unchanged(as_stored(cpu), cpu, {})
    older = as_stored(cpu.replace(token_buckets=(16, 64, 256), max_num_seqs=8))
    assert not _target_unchanged(older, cpu, {})
    # what the compile options chose is not the built-in target's business
    assert _target_unchanged(older, cpu, {"buckets": [16, 64, 256], "max_num_seqs": 8})
