"""Talking to a sidecar over HTTP in tests: requests and server-sent events."""

from __future__ import annotations

import json

import httpx

SQL = {"X-Business-Line": "code_assistant", "X-Task": "sql"}


def post(url: str, path: str, body: dict, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers or {}, timeout=timeout)


def sse_events(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
