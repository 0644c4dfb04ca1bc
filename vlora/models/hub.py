"""Hugging Face Hub ids (``org/name[@revision]``) for models and adapters, resolved to local directories.

A local path always wins: an argument names the Hub only when no file or directory of that name exists.
Downloads go through ``huggingface_hub.snapshot_download`` and its cache, so ``HF_HOME`` / ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, ``HF_TOKEN`` and ``@revision`` (branch, tag or commit) work as in transformers; a cached
snapshot is used when the Hub cannot be reached. Only the files vlora reads are fetched (safetensors, JSON
configs, tokenizer files), never pickles, GGUF or ONNX copies.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# org/name with the Hub's characters, then an optional @revision (branch, tag or commit hash)
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<rev>[^\s@]+))?$")
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "vlora_head.json", "vlora_head.safetensors"]


class HubError(ValueError):
    """A Hub id that is neither cached nor downloadable (offline, unknown, gated, bad revision)."""


def is_hub_id(spec) -> bool:
    """Whether ``spec`` has the form of a Hub id, org/name[@revision] (whatever exists locally)."""
    return isinstance(spec, str) and _HUB_ID.match(spec) is not None


def parse_hub_id(spec) -> tuple[str, str | None] | None:
    """(repo_id, revision) when ``spec`` is a Hub id and no local path of that name exists, else None."""
    if not is_hub_id(spec) or os.path.exists(spec):
        return None
    m = _HUB_ID.match(spec)
    return m["repo"], m["rev"]


def snapshot_dir(spec: str, kind: str) -> Path:
    """The local snapshot of Hub id ``spec`` (``kind``: "model" or "adapter"), downloaded if needed (with a
    progress bar); a cached one is used when the Hub is offline or unreachable."""
    m = _HUB_ID.match(spec) if isinstance(spec, str) else None
    if m is None:
        raise HubError(f"{kind} {spec!r} is not a Hub id (org/name[@revision])")
    repo, revision = m["repo"], m["rev"]
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{kind} {spec!r}"
    try:
        path = snapshot_download(repo, revision=revision, allow_patterns=ADAPTER_FILES if kind == "adapter"
                                 else MODEL_FILES, ignore_patterns=["*/*"])
    except LocalEntryNotFoundError:
        how = ("the Hub is offline (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE
               else "the Hub could not be reached")
        raise HubError(f"{where} is not a local path, is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                       f"and {how}") from None
    except GatedRepoError:
        raise HubError(f"{where}: the repository is gated; accept its terms on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise HubError(f"{where} is not a local path, and the Hub has no such repository (or it is private: "
                       f"set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{where}: the Hub repository has no revision {revision!r}") from None
    except (HfHubHTTPError, OSError) as e:
        raise HubError(f"{where}: download failed ({type(e).__name__}: {e})") from None
    return Path(path)


def hub_name(path: Path) -> str | None:
    """'org/name' when ``path`` is a snapshot in the Hub cache (…/models--org--name/snapshots/<commit>)."""
    path = Path(path)
    if path.parent.name != "snapshots" or not path.parent.parent.name.startswith("models--"):
        return None
    return path.parent.parent.name.removeprefix("models--").replace("--", "/", 1)


def display_name(model_dir: Path) -> str:
    """The model's name in the API and logs: its Hub id for a cached snapshot, else the directory's name."""
    return hub_name(model_dir) or Path(model_dir).name


def resolve_adapter_dir(spec: str | os.PathLike) -> Path:
    """A local adapter directory for ``spec``: the path itself, or the snapshot of a Hub id."""
    return snapshot_dir(spec, "adapter") if parse_hub_id(spec) else Path(spec)
