"""The commands that talk to a running sidecar (``retune``, ``fleet``) make their calls here: one request, the
admin token from ``MLA_WATCH_ADMIN_TOKEN``, and an error answer turned into one line and a non-zero exit."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["DEFAULT_SIDECAR_URL", "call_sidecar", "sidecar_url_flag"]

DEFAULT_SIDECAR_URL = "http://127.0.0.1:8000"


def sidecar_url_flag(parser: argparse.ArgumentParser, text: str) -> None:
    """The ``--url`` of a command that talks to a running sidecar."""
    parser.add_argument("--url", default=DEFAULT_SIDECAR_URL, help=text)


def call_sidecar(command: str, url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """``method path`` on the sidecar at ``url``: its JSON answer; ``SystemExit`` naming ``command`` and the
    sidecar's own message on a 4xx/5xx or when it cannot be reached."""
    import os

    import httpx

    token = os.environ.get("MLA_WATCH_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.request(method, url.rstrip("/") + path, json=body, headers=headers, timeout=60)
    except httpx.HTTPError as error:
        raise SystemExit(f"{command}: cannot reach the sidecar at {url}: {error}") from error
    try:
        document = response.json()
    except ValueError:
        document = {"error": {"message": response.text[:500]}}
    if response.status_code >= 400:
        message = (
            document.get("error", {}).get("message", response.text[:500])
            if isinstance(document, dict)
            else response.text[:500]
        )
        raise SystemExit(f"{command}: {method} {path} answered {response.status_code}: {message}")
    return document
