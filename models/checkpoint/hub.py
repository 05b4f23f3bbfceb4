"""Hugging Face Hub ids as model sources: `org/name`, `org/name@revision`, or one GGUF of a repo, `org/name:FILE.gguf`.

`fetch(ref)` resolves the id through `huggingface_hub` into its cache (HF_HOME, HF_HUB_CACHE, HF_TOKEN and
HF_HUB_OFFLINE honoured; the cache is shared with transformers and vLLM) and returns the local snapshot folder — only
the files kiln reads are downloaded — or the one .gguf file. `hub_id(path)` gives back (id, revision) for a path
inside that cache, so artifacts are named after the model and their manifest records where it came from.
"""

from __future__ import annotations

import re
from pathlib import Path

from kiln.models.errors import KilnError

# what a checkpoint folder is read from (hf.py, kiln.models.checkpoint.tokenizer): no *.bin, *.pt, *.gguf, images
FILES = [
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "tokenizer.model", "vocab.json", "merges.txt",
]  # fmt: skip
_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<rev>[\w./-]+?))?(?::(?P<file>[\w./-]+\.gguf))?$")


def parse(ref: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, revision, GGUF file name) of a Hub reference, or None when `ref` does not look like one."""
    m = _ID.match(ref)
    if m is None or ref.startswith((".", "/", "~")):
        return None
    return m["repo"], m["rev"], m["file"]


def fetch(ref: str) -> Path:
    """The local folder (or .gguf file) of a Hub reference, downloaded into the Hugging Face cache if needed."""
    repo, revision, filename = parse(ref) or (None, None, None)
    if repo is None:
        raise KilnError(f"{ref!r} is neither a local path nor a Hugging Face id (org/name[@revision]).")
    import huggingface_hub
    from huggingface_hub import errors

    try:
        if filename:
            return Path(huggingface_hub.hf_hub_download(repo, filename, revision=revision))
        return Path(huggingface_hub.snapshot_download(repo, revision=revision, allow_patterns=FILES))
    except errors.GatedRepoError:
        raise KilnError(
            f"The Hugging Face model {repo} is gated: accept its terms on its page, then set HF_TOKEN to a token "
            "of that account."
        ) from None
    except errors.RepositoryNotFoundError:
        raise KilnError(
            f"No Hugging Face model {repo} was found (or it is private: set HF_TOKEN); check the id."
        ) from None
    except errors.RevisionNotFoundError:
        raise KilnError(f"The Hugging Face model {repo} has no revision {revision!r}.") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        raise KilnError(
            f"{ref} is not in the Hugging Face cache and cannot be downloaded now (offline, or HF_HUB_OFFLINE=1); "
            "download it once with network access."
        ) from None
    except errors.RemoteEntryNotFoundError:
        raise KilnError(f"The Hugging Face model {repo} has no file {filename!r}.") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise KilnError(f"Downloading {ref} from the Hugging Face Hub failed: {str(e).splitlines()[0][:160]}") from None


def hub_id(path: Path) -> tuple[str, str] | None:
    """(repo id, revision) of a snapshot folder or file inside the Hugging Face cache
    (.../models--org--name/snapshots/REV[/FILE]), else None."""
    parts = path.absolute().parts  # not resolve(): a snapshot's files are links into the cache's blobs
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return parts[i - 1].removeprefix("models--").replace("--", "/", 1), parts[i + 1]
    return None
