"""A real HTTP receiver for notification tests: loopback, port 0 (or a given port), in a thread.

It records every request and answers from a programmable script of :class:`Reply` objects
(one per request, in order; ``default`` once the script is used up): a status with headers and
body, a delay before answering (a slow receiver), or bytes that are not HTTP at all (garbage).
``on_request`` runs in the handler before the reply, to look at the world from the receiver's
side (e.g. at the outbox database through a separate connection).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b"ok"
    delay: float = 0.0  # seconds to wait before answering
    garbage: bytes | None = None  # raw bytes sent instead of an HTTP response, then the connection closes


OK = Reply()


def status(code: int, **headers: str) -> Reply:
    return Reply(status=code, headers={k.replace("_", "-"): v for k, v in headers.items()})


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() when the request arrived
    reply: Reply

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        for key, value in self.headers.items():
            if key.lower() == name.lower():
                return value
        return None


class TestReceiver:
    """The recording, scripted receiver; see :func:`running_receiver`."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        script: list[Reply] | None = None,
        default: Reply = OK,
        on_request: Callable[[Received], None] | None = None,
    ) -> None:
        self.script = list(script or [])
        self.default = default
        self.on_request = on_request
        self.requests: list[Received] = []
        self.errors: list[BaseException] = []  # exceptions raised by on_request
        self._lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    def next_reply(self) -> Reply:
        with self._lock:
            return self.script.pop(0) if self.script else self.default

    def wait_for(self, count: int, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.requests) >= count:
                return True
            time.sleep(0.01)
        return len(self.requests) >= count

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                reply = owner.next_reply()
                received = Received(self.command, self.path, dict(self.headers.items()), body, time.monotonic(), reply)
                if owner.on_request is not None:
                    try:
                        owner.on_request(received)
                    except BaseException as exc:  # surfaced to the test through .errors
                        owner.errors.append(exc)
                with owner._lock:
                    owner.requests.append(received)
                if reply.delay:
                    time.sleep(reply.delay)
                try:
                    if reply.garbage is not None:
                        self.wfile.write(reply.garbage)
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(reply.body)
                    self.close_connection = True
                except OSError:  # the client gave up (timeout) before we answered
                    self.close_connection = True

            do_PUT = do_POST

        return Handler


@contextmanager
def running_receiver(
    script: list[Reply] | None = None,
    *,
    default: Reply = OK,
    port: int = 0,
    on_request: Callable[[Received], None] | None = None,
) -> Iterator[TestReceiver]:
    """Serve a :class:`TestReceiver` on 127.0.0.1 (port 0 = a free one) for the ``with`` block."""
    receiver = TestReceiver(script, default, on_request)
    server = ThreadingHTTPServer(("127.0.0.1", port), receiver._handler())
    server.daemon_threads = True
    receiver.server = server
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
