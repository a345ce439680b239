"""The router: policies, worker registry and health, the PD proxy flow (DESIGN.md §3, §7)."""

from pd.router.app import make_app
from pd.router.config import RouterConfig
from pd.router.register import RegistrationError, deregister_from_router, register_with_router

__all__ = [
    "RegistrationError",
    "RouterConfig",
    "deregister_from_router",
    "make_app",
    "register_with_router",
]
