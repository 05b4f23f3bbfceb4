"""kiln.compile: checkpoint + target -> artifact (build.compile_artifact), artifact -> ready programs (artifact.load).

plan.py holds every option's default and check (used by the jit path in kiln.serving too); lower.py describes the
programs, executable.py serializes them, convert.py lays the weights out. It imports kiln.models and kiln.targets,
never kiln.serving; `kiln compile` (compile_cmd.py) is its command.

`ensure_artifact(source, target, **options)` is what `kiln serve MODEL` uses: it returns the artifact compiled from
`source` for `target` under artifacts/, compiling it first unless a matching one is already there.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

__all__ = ["ensure_artifact"]

ENGINE_OPTIONS = ("enable_prefix_caching", "model_name", "warmup")  # engine settings that do not change an artifact


def ensure_artifact(source: str | Path | None, target: str, **options) -> Path:
    """The artifact of `source` for `target` (artifacts/<model>.<target>/ unless options has `out`), compiled unless
    one built by this kiln's code from the same source files with the same target and options is there."""
    from kiln.compile.checks import code_fingerprint, model_name, source_fingerprint  # build is imported to compile
    from kiln.compile.plan import Options
    from kiln.models.checkpoint import resolve_source
    from kiln.targets.target import get_target

    out = options.pop("out", None)
    for engine_only in ENGINE_OPTIONS:
        options.pop(engine_only, None)
    resolved = get_target(target)
    src = resolve_source(source)
    root = Path(os.environ.get("KILN_ARTIFACTS", "artifacts"))
    path = Path(out) if out else root / f"{model_name(src)}.{resolved.name}"
    wanted = Options.from_kwargs(**options).to_dict()
    manifest_path = path / "manifest.json"
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            manifest = {}
        from kiln.compile.artifact import FORMAT_VERSION

        if (
            manifest.get("format") == FORMAT_VERSION  # an artifact of an older kiln is rebuilt
            and manifest.get("source") == source_fingerprint(src)
            and manifest.get("options") == wanted
            and manifest.get("target", {}).get("name") == resolved.name
            and _target_unchanged(manifest["target"], resolved, wanted)
        ):
            if manifest.get("code") == code_fingerprint():
                return path
            logging.getLogger("kiln.compile").info("%s was compiled by another kiln's code: compiling it again", path)
    from kiln.compile.build import compile_artifact

    return compile_artifact(src, target, out=path, **options)


def _target_unchanged(stored: dict, target, wanted: dict) -> bool:
    """Whether the stored artifact's target is the built-in target with the same options applied (a newer kiln may
    change a target's buckets or sizes). The device kind and count are filled in from the GPU at compile time."""
    from kiln.compile.plan import Options, resolve_target
    from kiln.models import gguf_quant

    now = json.loads(json.dumps(resolve_target(target, Options.from_kwargs(**wanted)).to_dict()))

    def same(key: str, value) -> bool:
        if key == "weight_format" and value == "gguf":  # stored as what it resolved to: the file's kinds, or float
            found = stored.get(key) or ""
            return found in ("gguf", "float") or gguf_quant.parse_format(found) is not None
        return stored.get(key) == value

    return all(same(key, value) for key, value in now.items() if key not in ("device_kind", "device_count"))
