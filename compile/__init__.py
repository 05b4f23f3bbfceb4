"""kiln.compile: checkpoint + target -> artifact (build.compile_artifact), artifact -> ready programs (artifact.load).

`ensure_artifact(source, target, **options)` is what `kiln serve MODEL` uses: it returns the artifact compiled from
`source` for `target` under artifacts/, compiling it first unless a matching one is already there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kiln.models.errors import KilnError

__all__ = ["ensure_artifact"]

ENGINE_OPTIONS = ("enable_prefix_caching", "model_name", "warmup")  # engine settings that do not change an artifact


def ensure_artifact(source: str | Path | None, target: str, **options) -> Path:
    """The artifact of `source` for `target` (artifacts/<model>.<target>/ unless options has `out`), compiled unless
    one built from the same source files with the same target and options is there."""
    from kiln.compile.build import CompileOptions, compile_artifact, model_name, source_fingerprint
    from kiln.models.checkpoint import resolve_source
    from kiln.targets.target import get_target

    out = options.pop("out", None)
    for engine_only in ENGINE_OPTIONS:
        options.pop(engine_only, None)
    resolved = get_target(target)
    src = resolve_source(source)
    root = Path(os.environ.get("KILN_ARTIFACTS", "artifacts"))
    path = Path(out) if out else root / f"{model_name(src)}.{resolved.name}"
    try:
        wanted = CompileOptions(**options).to_dict()
    except TypeError as e:
        raise KilnError(f"Unknown compile option: {e}.") from None
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
            return path
    return compile_artifact(src, target, out=path, **options)


def _target_unchanged(stored: dict, target, wanted: dict) -> bool:
    """Whether the built-in target still describes what the stored artifact was compiled for (a newer kiln may
    change a target's buckets or sizes); fields the compile options overrode are not compared."""
    same = {"page_size": target.page_size, "memory_fraction": target.memory_fraction}
    same["xla_flags"] = list(target.xla_flags)
    if wanted.get("buckets") is None and wanted.get("max_num_batched_tokens") is None:
        same["token_buckets"] = list(target.token_buckets)
    if wanted.get("max_num_seqs") is None:
        same["max_num_seqs"] = target.max_num_seqs
    if wanted.get("attention") is None:
        same["attention"] = target.attention
    if wanted.get("dtype") is None:
        same["compute_dtype"], same["kv_dtype"] = target.compute_dtype, target.kv_dtype
    if wanted.get("max_model_len") is None:
        same["max_model_len"] = target.max_model_len
    return all(stored.get(key) == value for key, value in same.items())
