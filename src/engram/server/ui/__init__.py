"""The memory console: server-rendered pages at /ui over the same authentication, tenants and
public `Memory` methods as the REST API (see docs/console.md)."""

from __future__ import annotations

from fastapi import FastAPI

from .routes import router

__all__ = ["mount"]


def mount(app: FastAPI) -> None:
    """Serve the console at /ui (after `app.state.auth`, `.limiter` and `.tenants` are set)."""
    app.include_router(router)
