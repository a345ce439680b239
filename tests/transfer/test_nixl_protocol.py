"""`NixlAgent`/`NixlXferHandle` (nixl_compat.py) match the installed NIXL's Python API."""

from __future__ import annotations

import importlib
import inspect

import pytest

from pd.transfer import import_nixl, nixl_available
from pd.transfer.nixl_compat import NixlAgent, NixlXferHandle

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs a NIXL package")


def _members(proto: type) -> list[str]:
    return [n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")]


@pytest.mark.parametrize(
    "proto, real_name", [(NixlAgent, "nixl_agent"), (NixlXferHandle, "nixl_xfer_handle")]
)
def test_every_protocol_call_is_accepted_by_nixl(proto, real_name):
    api = importlib.import_module(import_nixl().nixl_agent.__module__)  # where both classes live
    real_cls = getattr(api, real_name)
    names = _members(proto)
    assert names, proto
    for name in names:
        real = getattr(real_cls, name, None)
        assert callable(real), f"{real_name} has no method {name}"
        want = list(inspect.signature(getattr(proto, name)).parameters)
        # The backend calls with the protocol's parameters, by position: NIXL must accept that.
        inspect.signature(real).bind(*want)
