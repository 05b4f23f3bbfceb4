"""`kiln targets`: the built-in hardware targets, what each needs, and what `auto` resolves to here."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print every target's full data as JSON")


def run(args: argparse.Namespace) -> int:
    from kiln.targets.target import BUILTIN

    if args.json:
        print(json.dumps({name: t.to_dict() for name, t in BUILTIN.items()}, indent=1))
        return 0
    width = max(len(n) for n in BUILTIN)
    for name, t in BUILTIN.items():
        print(f"{name:<{width}}  {t.description}; attention {t.attention}, {t.compute_dtype}")
        print(f"{'':<{width}}  needs: {t.needs}")
    try:
        from kiln.targets.detect import detect_target

        here = f"{detect_target().name}"
    except Exception as e:  # a broken accelerator runtime must not hide the list
        here = f"unknown ({e.__class__.__name__})"
    print(f"{'auto':<{width}}  what this machine has: {here}")
    return 0
