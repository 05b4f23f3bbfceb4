"""Pick the decode programs' settings from a gpu_profile.py --json run and, with --write, set them as
models/kernels/pallas_gpu.py's defaults (on a device copy of the tree, ahead of a served run in the same call).

    python benchmarks/gpu_pick.py PROFILE.json [--base fused] [--write] [--gain 0.01]

A variant beats the base at a concurrency when its kernel sum per token is at least --gain (a fraction) under the
base's and its wall time per token is no more than --gain over it: the kernel sum is the steadier figure, the wall
time counts the first call's dispatch and the first variant of a process has run slower in every session's runs.
At c = 1 (the decode program of 16 rows) the best winner by kernel time is taken; its XLA options (";xla=...") become
pallas_gpu.DECODE_XLA_OPTIONS, up to 64 rows where it also won at c = 64 (16 otherwise), its ";add_norm=P" and
";qkv_pieces=P" ADD_NORM_PIECES and QKV_PIECES. Prints a table of every variant against the base; exits 0 when a
default was chosen (and written), 1 when the base stays.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

PALLAS_GPU = Path(__file__).resolve().parent.parent / "models" / "kernels" / "pallas_gpu.py"


def options(variant: str) -> dict:
    """A gpu_profile variant's ;KEY=VALUE options; xla's FLAG:VALUE list as a dict of typed XLA options."""
    _, *opts = variant.split(";")
    out = dict(o.split("=", 1) for o in opts)
    xla = {}
    for item in out.pop("xla", "").split("/") if "xla" in out else []:
        flag, value = item.split(":")
        value = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
        xla[flag if flag.startswith("xla_") else f"xla_gpu_{flag}"] = value
    out["xla"] = xla
    return out


def table(levels: list[dict]) -> dict[tuple[str, int], dict]:
    """(variant, concurrency) -> the multi program's figures (the last run of a variant named twice wins)."""
    return {(r["variant"], r["concurrency"]): {**r["multi"], "roofline_ms": r["roofline_ms"]} for r in levels
            if "multi" in r}  # fmt: skip


def wins(row: dict, base: dict, gain: float) -> bool:
    kernels = row["kernel_ms_per_token"] <= base["kernel_ms_per_token"] * (1 - gain)
    return kernels and row["ms_per_token"] <= base["ms_per_token"] * (1 + gain)


def pick(levels: list[dict], base: str, gain: float) -> tuple[str | None, dict]:
    """(the winning variant or None, the settings to write)."""
    rows = table(levels)
    for (variant, c), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[1]["kernel_ms_per_token"])):
        b = rows.get((base, c))
        vs = "-"
        if b and b["kernel_ms_per_token"] > 0:
            vs = f"{r['kernel_ms_per_token'] / b['kernel_ms_per_token']:.3f} / "
            vs += f"{r['ms_per_token'] / b['ms_per_token']:.3f}"
        print(f"| {variant} | {c} | {r['ms_per_token']:.3f} | {r['kernel_ms_per_token']:.3f} | "
              f"{r['roofline_ms'] / r['ms_per_token']:.3f} | {vs} |")  # fmt: skip
    b1 = rows.get((base, 1))
    if b1 is None:
        return None, {}
    ones = [(v, r) for (v, c), r in rows.items() if c == 1 and v != base]
    winners = [(r["kernel_ms_per_token"], v) for v, r in ones if wins(r, b1, gain)]
    if not winners:
        return None, {}
    best = min(winners)[1]
    opts = options(best)
    b64, r64 = rows.get((base, 64)), rows.get((best, 64))
    settings = {
        "DECODE_XLA_OPTIONS": opts["xla"],
        "DECODE_XLA_MAX_ROWS": 64 if b64 and r64 and wins(r64, b64, gain) else 16,
        "ADD_NORM_PIECES": int(opts.get("add_norm", 0)),
        "QKV_PIECES": int(opts.get("qkv_pieces", 0)),
    }
    return best, settings


def write(settings: dict, path: Path = PALLAS_GPU) -> None:
    text = path.read_text()
    for name, value in settings.items():
        pattern = rf"^{name}(: [^=\n]+)? = .*$"
        assert re.search(pattern, text, flags=re.M), name
        text = re.sub(pattern, lambda m, n=name, v=value: f"{n}{m.group(1) or ''} = {v!r}", text, count=1, flags=re.M)
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--base", default="fused")
    ap.add_argument("--gain", type=float, default=0.01)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    levels = json.loads(Path(args.profile).read_text())["levels"]
    print("| variant | c | wall ms/token | kernels ms/token | wall / roofline | kernels / wall vs base |")
    best, settings = pick(levels, args.base, args.gain)
    print(f"winner at c = 1: {best or 'none (the base stays)'} {settings}")
    if best and args.write:
        write(settings)
        print(f"written to {PALLAS_GPU}")
    raise SystemExit(0 if best else 1)


if __name__ == "__main__":
    main()
