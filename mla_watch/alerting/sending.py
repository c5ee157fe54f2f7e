"""Sending one notification request: the HTTP call with its deadline, what came of it (:class:`SendResult`, errors
scrubbed of the request's secrets), and when to try again (``Retry-After``, backoff)."""

from __future__ import annotations

import email.utils
import http.client
import json
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mla_watch.alerting.notifiers import OutgoingRequest

__all__ = [
    "MAX_RETRY_AFTER",
    "SendResult",
    "backoff_delay",
    "parse_retry_after",
    "send_request",
]

MAX_RETRY_AFTER = 24 * 3600.0
_ERROR_BODY_BYTES = 300


@dataclass(frozen=True)
class SendResult:
    """What one POST came to: an HTTP status, or None when no valid response arrived."""

    status: int | None
    error: str = ""
    retry_after: str | None = field(default=None)  # the raw Retry-After header, if any
    permanent: bool = False  # no status, but retrying cannot help (e.g. an invalid URL)

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def _scrub(text: str, request: OutgoingRequest) -> str:
    """Remove anything secret-looking that a receiver might echo: the URL, its path and query, header values."""
    secrets = [request.url]
    try:
        parts = urlsplit(request.url)
        secrets += [parts.path, parts.query, parts.netloc]
        secrets += [seg for seg in parts.path.split("/") if len(seg) >= 6]
    except ValueError:
        pass
    secrets += [
        str(v) for k, v in request.headers.items() if k.lower() not in ("content-type", "user-agent", "idempotency-key")
    ]
    try:  # PagerDuty's routing key travels in the body
        payload = json.loads(request.body)
        if isinstance(payload, dict) and payload.get("routing_key"):
            secrets.append(str(payload["routing_key"]))
    except (ValueError, UnicodeError):
        pass
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, "<redacted>")
    return text


def _describe_exception(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or 'connection error'}"
    return f"{type(exc).__name__} (malformed or missing response)"


def send_request(request: OutgoingRequest, timeout: float) -> SendResult:
    """POST ``request`` once, within about ``timeout`` seconds overall; never raises for network trouble.

    Uses :mod:`http.client` directly: no proxies from the environment, no redirects followed.
    """
    deadline = time.monotonic() + max(0.001, float(timeout))

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        return left

    try:
        parts = urlsplit(request.url)
        host, port = parts.hostname, parts.port
        if parts.scheme not in ("http", "https") or not host:
            raise ValueError("bad URL")
    except ValueError:
        return SendResult(None, "invalid URL (scheme, host or port)", permanent=True)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=remaining())
    try:
        conn.connect()
        conn.sock.settimeout(remaining())
        headers = dict(request.headers)
        headers.setdefault("Content-Type", "application/json")
        conn.request("POST", path, body=request.body, headers=headers)
        sock = conn.sock
        sock.settimeout(remaining())
        response = conn.getresponse()  # may detach conn.sock (Connection: close); the response keeps it open
        status = int(response.status)
        error = ""
        if not 200 <= status < 300:
            snippet = b""
            try:
                sock.settimeout(remaining())
                snippet = response.read(_ERROR_BODY_BYTES)
            except Exception:  # best effort: the status is what matters
                pass
            text = snippet.decode("utf-8", errors="replace").strip()
            text = "".join(ch if ch.isprintable() else " " for ch in text)[:200]
            error = f"HTTP {status} {str(response.reason)[:80]}".strip() + (f": {text}" if text else "")
            error = _scrub(error, request)
        return SendResult(status, error, retry_after=response.getheader("Retry-After"))
    except (http.client.InvalidURL, UnicodeError) as exc:
        return SendResult(None, _describe_exception(exc), permanent=True)
    except Exception as exc:  # timeouts, refused connections, TLS errors, garbage responses
        return SendResult(None, _describe_exception(exc))
    finally:
        conn.close()


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from a Retry-After header (delay-seconds or an HTTP-date); None if absent/invalid."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - now
    if seconds != seconds:  # NaN
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER)


def backoff_delay(failures: int, base: float, cap: float, rng: random.Random) -> float:
    """Full jitter: ``uniform(0, min(cap, base * 2**failures))`` (``failures`` = failed attempts before this one)."""
    ceiling = min(float(cap), float(base) * (2.0 ** min(int(failures), 60)))
    return rng.uniform(0.0, max(0.0, ceiling))
