"""Where `--dtype auto` / `--quantization auto` keep what they measured (kernel_choice.py): one
JSON file per key under `$PD_CACHE_DIR/kernels/` (default `~/.cache/pd/kernels/`). The key is
everything the measurement depends on (`cache_key`): the CPU (model name and every flag), the
checkpoint's digest, the role and its batch sizes, the threads, the TP size, torch's version and
what was pinned, so a choice never follows a worker to another machine, model or role. A file
that cannot be read or parsed is a miss (the search runs again and rewrites it)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The search's version: a change to what it measures or how it decides bumps it (2: splits;
# 3: the smallest batch drops nothing; 4: the LM head measured on its own; 5: onednn-fp32;
# 6: candidates timed side by side in rounds, nothing dropped under 32 rows; 7: smooth-int8,
# the plain dynamic int8 layers out where it runs, a compiled one-row step counted).
VERSION = 7


def cache_root() -> Path:
    """pd's cache directory: `$PD_CACHE_DIR`, default `~/.cache/pd`."""
    root = os.environ.get("PD_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pd"


def cache_dir() -> Path:
    return cache_root() / "kernels"


def cache_key(**fields: Any) -> dict[str, Any]:
    """The key as a JSON-able dict (sorted flags), with the search's version."""
    return {
        "version": VERSION,
        **{k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in fields.items()},
    }


def _path(key: dict[str, Any], root: Path) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return root / f"{digest}.json"


def load(key: dict[str, Any], root: Path | None = None) -> dict[str, Any] | None:
    """The stored choice for `key`, or None."""
    path = _path(key, root or cache_dir())
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        return None
    choice = stored.get("choice")
    return choice if isinstance(choice, dict) else None


def store(key: dict[str, Any], choice: dict[str, Any], root: Path | None = None) -> Path | None:
    """Write the choice (atomically: a worker starting beside reads all or nothing); None and a
    warning when the directory cannot be written (the choice is then measured at each start)."""
    path = _path(key, root or cache_dir())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "choice": choice}, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        log.warning("kernel choice not cached (%s): it is measured again at the next start", e)
        return None
    return path
