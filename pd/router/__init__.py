"""The router: policies, worker registry and health, the PD proxy flow (DESIGN.md §3, §7)."""

from pd.registration import RegistrationError, deregister_from_router, register_with_router
from pd.router.app import make_app
from pd.router.config import RouterConfig

__all__ = [
    "RegistrationError",
    "RouterConfig",
    "deregister_from_router",
    "make_app",
    "register_with_router",
]
