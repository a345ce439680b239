"""Import NIXL whichever way it is installed: `nixl` (meta package), `nixl_cu12` or `nixl_cu13`."""

from __future__ import annotations

import importlib
from types import ModuleType

from pd.transfer.errors import BackendUnavailable

_CANDIDATES = ("nixl", "nixl_cu12", "nixl_cu13")
_cached: ModuleType | None = None


def import_nixl() -> ModuleType:
    """The NIXL Python module (exposing `nixl_agent`, `nixl_agent_config`), or BackendUnavailable."""
    global _cached
    if _cached is not None:
        return _cached
    errors = []
    for name in _CANDIDATES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if not hasattr(mod, "nixl_agent"):  # e.g. the meta package without a wheel behind it
            try:
                mod = importlib.import_module(f"{name}._api")
            except ImportError as e:
                errors.append(f"{name}: no nixl_agent ({e})")
                continue
        _cached = mod
        return mod
    raise BackendUnavailable(
        "no NIXL package importable (pip install nixl-cu12 or nixl-cu13); tried "
        + "; ".join(errors)
    )


def nixl_available() -> bool:
    try:
        import_nixl()
    except BackendUnavailable:
        return False
    return True


def make_agent(nixl: ModuleType, name: str, config: object, progress_delay_us: int) -> object:
    """`nixl.nixl_agent(name, config)`, with the progress thread sleeping `progress_delay_us`
    between its passes. NIXL's Python wrapper hard-codes 0 (a busy loop: a whole core per idle
    agent); the C++ config has the knob, so it is set on the config as the agent is built."""
    api = importlib.import_module(nixl.nixl_agent.__module__)
    bind = api.nixlBind
    real = bind.nixlAgent

    def build(agent_name: str, agent_config: object) -> object:
        agent_config.pthrDelay = progress_delay_us
        return real(agent_name, agent_config)

    bind.nixlAgent = build
    try:
        return nixl.nixl_agent(name, config)
    finally:
        bind.nixlAgent = real
