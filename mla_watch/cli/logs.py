"""The sidecar's log: its own lines at the level asked for, the libraries' only when they warn.

The libraries ``serve`` runs on log for their own debugging: the HTTP client logs every request it sends
(the engine's health every 5 s, each reference prompt), the HTTP server every request it answers. At the
default level those lines would bury the sidecar's own, so they are held to warnings and errors;
``--log-level debug`` lets everything through.
"""

from __future__ import annotations

import logging

__all__ = ["LIBRARY_LOGGERS", "LOG_FORMAT", "LOG_LEVELS", "configure_logging", "library_level"]

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# uvicorn's own start-up lines ("Uvicorn running on ...") are the server's, not a library's chatter: uvicorn
# itself is given the level asked for; its per-request access lines only at debug (run_server's access_log).
# transformers keeps its own handler and its default level (warnings), whatever is set here.
LIBRARY_LOGGERS = (
    "httpx",
    "httpcore",
    "urllib3",
    "asyncio",
    "filelock",
    "apscheduler",
    "huggingface_hub",
    "psycopg",
    "uvicorn.access",
)


def library_level(level: str) -> int:
    """The level the libraries' loggers get when ``serve`` runs at ``level``: theirs pass at debug only."""
    return logging.DEBUG if level == "debug" else max(logging.WARNING, logging.getLevelName(level.upper()))


def configure_logging(level: str) -> None:
    """The root logger at ``level`` (one of :data:`LOG_LEVELS`) in the sidecar's format, the libraries' quieter."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(library_level(level))
