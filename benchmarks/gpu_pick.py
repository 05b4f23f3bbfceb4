"""Pick the decode programs' XLA options per bucket from a gpu_profile.py --json run and, with --write, set them as
models/kernels/pallas_gpu.py's DECODE_XLA_OPTIONS (on a device copy of the tree, ahead of a served run in the same
call).

    python benchmarks/gpu_pick.py PROFILE.json [--base fused] [--write] [--gain 0.01]

A variant of the base's layout whose only option is ";xla=..." beats the base at a concurrency when its kernel sum per
token is at least --gain (a fraction) under the base's and its wall time per token no more than --gain over it: the
kernel sum is the steadier figure, the wall time counts the first call's dispatch, and the first variant of a process
has run slower in every session's runs. The best winner by kernel time at a concurrency gives the XLA options of that
concurrency's decode bucket. Prints a table of every variant against the base; exits 0 when some bucket got options
(written with --write), 1 when every bucket keeps XLA's defaults.
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
    return {(r["variant"], r["concurrency"]): {**r["multi"], "roofline_ms": r["roofline_ms"], "bucket": r["bucket"]}
            for r in levels if "multi" in r}  # fmt: skip


def wins(row: dict, base: dict, gain: float) -> bool:
    kernels = row["kernel_ms_per_token"] <= base["kernel_ms_per_token"] * (1 - gain)
    return kernels and row["ms_per_token"] <= base["ms_per_token"] * (1 + gain)


def pick(levels: list[dict], base: str, gain: float) -> dict[int, tuple[str, dict]]:
    """{decode bucket: (the winning variant, its XLA options)} for the concurrencies where one won."""
    rows = table(levels)
    for (variant, c), r in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[1]["kernel_ms_per_token"])):
        b = rows.get((base, c))
        vs = "-"
        if b and b["kernel_ms_per_token"] > 0:
            vs = f"{r['kernel_ms_per_token'] / b['kernel_ms_per_token']:.3f} / "
            vs += f"{r['ms_per_token'] / b['ms_per_token']:.3f}"
        print(f"| {variant} | {c} | {r['ms_per_token']:.3f} | {r['kernel_ms_per_token']:.3f} | "
              f"{r['roofline_ms'] / r['ms_per_token']:.3f} | {vs} |")  # fmt: skip
    layout = base.split(";")[0]
    chosen = {}
    for c in sorted({c for _, c in rows}):
        b = rows.get((base, c))
        if b is None:
            continue
        candidates = [(v, r) for (v, cc), r in rows.items() if cc == c and v != base and v.split(";")[0] == layout]
        candidates = [(v, r) for v, r in candidates if set(options(v)) - {"max_c"} == {"xla"} and options(v)["xla"]]
        winners = [(r["kernel_ms_per_token"], v) for v, r in candidates if wins(r, b, gain)]
        if winners:
            best = min(winners)[1]
            chosen[rows[(best, c)]["bucket"]] = (best, options(best)["xla"])
    return chosen


def write(options: dict[int, dict], path: Path = PALLAS_GPU) -> None:
    """Set pallas_gpu.DECODE_XLA_OPTIONS to `options` ({bucket: XLA options}) in the file."""
    text = path.read_text()
    pattern = r"^DECODE_XLA_OPTIONS(: [^=\n]+)? = .*$"
    assert re.search(pattern, text, flags=re.M)
    text = re.sub(pattern, lambda m: f"DECODE_XLA_OPTIONS{m.group(1) or ''} = {options!r}", text, count=1, flags=re.M)
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
    chosen = pick(levels, args.base, args.gain)
    for bucket, (variant, xla) in sorted(chosen.items()):
        print(f"decode bucket {bucket}: {variant} -> {xla}")
    print("" if chosen else "no variant won: every bucket keeps XLA's defaults")
    if chosen and args.write:
        write({bucket: xla for bucket, (_, xla) in chosen.items()})
        print(f"written to {PALLAS_GPU}")
    raise SystemExit(0 if chosen else 1)


if __name__ == "__main__":
    main()
