"""The REST service: a FastAPI face over `Memory`, with tenants, API keys and limits."""

from .app import create_app
from .limits import ServiceLimits

__all__ = ["ServiceLimits", "create_app"]
