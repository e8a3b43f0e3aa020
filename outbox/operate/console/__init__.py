"""The operator console: server-rendered pages for dead letters, replays, stats and keys."""

from outbox.operate.console.views import console_router

__all__ = ["console_router"]
