"""Working memory: what a model sees of the live conversation (policies, summaries, sessions)."""

from .policies import (
    POLICIES,
    All,
    Incremental,
    Policy,
    Progressive,
    SessionMessage,
    Summary,
    Tokens,
    Turns,
    View,
    Window,
)

__all__ = [
    "POLICIES",
    "All",
    "Incremental",
    "Policy",
    "Progressive",
    "SessionMessage",
    "Summary",
    "Tokens",
    "Turns",
    "View",
    "Window",
]
