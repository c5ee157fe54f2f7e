"""HTTP/1.1 to the engine behind the proxy: what forwarding needs, and nothing more.

Every generation request through the proxy is one request to the engine. A general-purpose client
(httpx over httpcore and h11, each a layer of pure Python) spent about 1 ms of CPU on each of them
here, more than the rest of the hop (``bench/proxy_hop.py``). This one writes a request in one
``write``, reads the answer's head with one bounded read, hands its body on as it arrives
(``Content-Length``, chunked, or until the engine closes the connection), and keeps the connection
for the next request where the answer allows it. How large and how long an answer may be is the
caller's to bound (:mod:`.upstream_io`); here only the head of an answer is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import ssl
import time
from collections.abc import AsyncIterator
from typing import overload
from urllib.parse import urlsplit

__all__ = ["HEAD_MAX_BYTES", "Headers", "UpstreamClient", "UpstreamError", "UpstreamResponse"]

log = logging.getLogger("mla_watch.server.upstream")

HEAD_MAX_BYTES = 100 << 10  # an answer's status line and headers, and each chunk-size line (httpcore's bound)
MAX_CONNECTIONS = 100  # to the engine at once; more requests wait for one (httpx's default)
MAX_IDLE = 20  # kept open between requests (httpx's default)
IDLE_SECONDS = 4.0  # an idle connection is not reused after this: uvicorn (vLLM, SGLang) closes them at 5 s
READ_BYTES = 1 << 20
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header's name (RFC 9110 5.1)
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")


class UpstreamError(Exception):
    """The engine could not be reached or did not speak HTTP/1.1; ``kind`` says which, in httpx's words
    (``ConnectError``, ``ConnectTimeout``, ``ReadError``, ``WriteError``, ``RemoteProtocolError``,
    ``LocalProtocolError``, ``UnsupportedProtocol``)."""

    def __init__(self, kind: str, detail: str, *, nothing_received: bool = False) -> None:
        super().__init__(detail)
        self.kind = kind
        self.nothing_received = nothing_received  # the connection ended before any byte of an answer


class Headers:
    """An answer's headers, looked up by name in any case; repeated ones joined with ``", "``."""

    def __init__(self, fields: list[tuple[str, str]]) -> None:
        self._values: dict[str, str] = {}
        for name, value in fields:
            self._values[name] = f"{self._values[name]}, {value}" if name in self._values else value

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._values.get(name.lower(), default)


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float) -> bool:
        """Open, not closed by the engine meanwhile, not idle for too long."""
        return not self.writer.is_closing() and not self.reader.at_eof() and now - self.idle_since < IDLE_SECONDS

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """An answer whose head has been read. Its body is read with :meth:`aiter_raw`, once; :meth:`aclose` (or
    leaving ``async with``) keeps the connection for the next request where the body was read to its end,
    and closes it otherwise."""

    def __init__(
        self,
        client: UpstreamClient,
        connection: _Connection,
        status_code: int,
        headers: Headers,
        *,
        length: int | None,
        chunked: bool,
        keep_alive: bool,
    ) -> None:
        self.status_code = status_code
        self.headers = headers
        self._client = client
        self._connection: _Connection | None = connection
        self._length = length  # None: chunked, or until the engine closes the connection
        self._chunked = chunked
        self._keep_alive = keep_alive
        self._read_to_end = length == 0

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives: without the chunked framing, still compressed where the engine compressed it."""
        if self._connection is None or self._read_to_end:
            return
        reader = self._connection.reader
        try:
            if self._chunked:  # all that has arrived at once, in one piece: a stream's events come in bursts
                chunks = _Dechunker()
                while not chunks.done:
                    raw = await reader.read(READ_BYTES)
                    if not raw:
                        raise UpstreamError(
                            "RemoteProtocolError", "the engine closed the connection in the middle of a chunked answer"
                        )
                    data = chunks.feed(raw)
                    if data:
                        yield data
                if chunks.extra:  # bytes past the answer's end: the connection is not to be trusted again
                    self._keep_alive = False
            elif self._length is None:
                while piece := await reader.read(READ_BYTES):
                    yield piece
            else:
                left = self._length
                while left:
                    piece = await reader.read(min(left, READ_BYTES))
                    if not piece:
                        raise UpstreamError(
                            "RemoteProtocolError",
                            f"the engine closed the connection {left} bytes short of its Content-Length {self._length}",
                        )
                    left -= len(piece)
                    yield piece
        except OSError as error:
            raise UpstreamError("ReadError", _said(error)) from None
        self._read_to_end = True

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._client._release(connection, reuse=self._read_to_end and self._keep_alive)

    def __del__(self) -> None:
        # An answer nobody closed (a stream whose client left before its relay began): its slot comes back.
        if self._connection is not None:
            with contextlib.suppress(Exception):  # the loop may be gone already
                self._client._release(self._connection, reuse=False)


class UpstreamClient:
    """Keep-alive HTTP/1.1 connections to one engine (``http`` or ``https``), at most :data:`MAX_CONNECTIONS`."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        credentials: tuple[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        parts = urlsplit(url)
        self._scheme = parts.scheme.lower()
        self._host = parts.hostname or ""
        default_port = 443 if self._scheme == "https" else 80
        try:
            self._port = parts.port or default_port
        except ValueError:  # out of range: said when a request is sent, as for a scheme that is not HTTP
            self._port = 0
        self._prefix = parts.path.rstrip("/")
        host = f"[{self._host}]" if ":" in self._host else self._host
        self._fixed = {
            "Host": host if self._port == default_port else f"{host}:{self._port}",
            "User-Agent": "mla-watch",
            **(headers or {}),
        }
        self.shown = f"{self._scheme}://{self._fixed['Host']}{self._prefix}"  # no credentials: they live apart
        self._authorization = (
            None
            if credentials is None
            else "Basic " + base64.b64encode(f"{credentials[0]}:{credentials[1]}".encode()).decode()
        )
        self.connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._tls: ssl.SSLContext | None = None

    async def send(self, method: str, path: str, *, headers: dict[str, str], body: bytes = b"") -> UpstreamResponse:
        """Send one request and read the head of its answer; raises :class:`UpstreamError`."""
        request = self._head(method, path, headers, body) + body
        if self._slots is None:  # made on the loop that uses it
            self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        await self._slots.acquire()
        try:
            answer = await self._send_on_a_connection(request, method)
        except BaseException:
            self._slots.release()
            raise
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s%s: HTTP %d", method, self.shown, path, answer.status_code)
        return answer

    async def aclose(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()

    # ------------------------------------------------------------------ internals
    def _head(self, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
        fields = {**self._fixed, **headers}
        if self._authorization is not None:  # the sidecar's own credentials replace the client's
            fields["Authorization"] = self._authorization
        if body or method == "POST":
            fields["Content-Length"] = str(len(body))
        lines = [f"{method} {self._prefix}{path} HTTP/1.1"]
        for name, value in fields.items():
            if "\r" in value or "\n" in value or "\x00" in value:
                raise UpstreamError("LocalProtocolError", f"the {name} header holds a line break or NUL")
            lines.append(f"{name}: {value}")
        # latin-1: a header arrives as bytes read as latin-1 (ASGI); a forwarded one leaves as the same bytes
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", errors="replace")

    async def _send_on_a_connection(self, request: bytes, method: str) -> UpstreamResponse:
        connection, reused = await self._connection()
        while True:
            try:
                return await self._exchange(connection, request, method)
            except UpstreamError as error:
                connection.close()
                if not (reused and error.nothing_received):
                    raise
            except BaseException:
                connection.close()
                raise
            # A kept connection the engine closed as it was taken (nothing came back): once more, on a new one.
            connection, reused = await self._connection(fresh=True)

    async def _connection(self, *, fresh: bool = False) -> tuple[_Connection, bool]:
        now = time.monotonic()
        while self._idle and not fresh:
            connection = self._idle.pop()
            if connection.usable(now):
                return connection, True
            connection.close()
        if self._scheme not in ("http", "https") or not self._host or not self._port:
            raise UpstreamError(
                "UnsupportedProtocol",
                f"cannot send a request to {self.shown}: expected an http:// or https:// URL with a host and a port",
            )
        if self._scheme == "https" and self._tls is None:
            import httpx  # its certificates: certifi's, or SSL_CERT_FILE / SSL_CERT_DIR

            self._tls = httpx.create_ssl_context()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self._host, self._port, ssl=self._tls, limit=HEAD_MAX_BYTES),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise UpstreamError("ConnectTimeout", f"no connection within {self.connect_timeout:g} s") from None
        except OSError as error:  # ssl.SSLError is one
            raise UpstreamError("ConnectError", _said(error)) from None
        return _Connection(reader, writer), False

    async def _exchange(self, connection: _Connection, request: bytes, method: str) -> UpstreamResponse:
        try:
            connection.writer.write(request)
            await connection.writer.drain()
        except OSError as error:
            raise UpstreamError("WriteError", _said(error), nothing_received=True) from None
        status, fields, version = await _read_head(connection.reader, first=True)
        while 100 <= status < 200 and status != 101:  # an interim answer (100 Continue, 103 Early Hints)
            status, fields, version = await _read_head(connection.reader, first=False)
        headers = Headers(fields)
        keep_alive = version == b"HTTP/1.1" and "close" not in (headers.get("connection") or "").lower()
        if method == "HEAD" or status in (101, 204, 304):
            return UpstreamResponse(self, connection, status, headers, length=0, chunked=False, keep_alive=keep_alive)
        encoding = (headers.get("transfer-encoding") or "").strip().lower()
        if encoding:
            if encoding != "chunked":
                raise UpstreamError(
                    "RemoteProtocolError", f"Transfer-Encoding {encoding[:40]!r}: only chunked is understood"
                )
            return UpstreamResponse(self, connection, status, headers, length=None, chunked=True, keep_alive=keep_alive)
        length = headers.get("content-length")
        if length is None:  # the body ends when the engine closes the connection
            return UpstreamResponse(self, connection, status, headers, length=None, chunked=False, keep_alive=False)
        if not length.isdigit():
            raise UpstreamError("RemoteProtocolError", f"Content-Length {length[:40]!r} is not a length")
        return UpstreamResponse(
            self, connection, status, headers, length=int(length), chunked=False, keep_alive=keep_alive
        )

    def _release(self, connection: _Connection, *, reuse: bool) -> None:
        if reuse and len(self._idle) < MAX_IDLE and not connection.writer.is_closing():
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()
        if self._slots is not None:
            self._slots.release()


async def _read_head(reader: asyncio.StreamReader, *, first: bool) -> tuple[int, list[tuple[str, str]], bytes]:
    """The status, the headers (names lower-cased) and the HTTP version of one answer."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        raise UpstreamError(
            "RemoteProtocolError",
            "the engine closed the connection in the middle of an answer's head"
            if error.partial
            else "the engine closed the connection without an answer",
            nothing_received=first and not error.partial,
        ) from None
    except asyncio.LimitOverrunError:
        raise UpstreamError(
            "RemoteProtocolError", f"an answer's status line and headers are longer than {HEAD_MAX_BYTES} bytes"
        ) from None
    except OSError as error:
        raise UpstreamError("ReadError", _said(error), nothing_received=first) from None
    status_line, *lines = head[:-4].split(b"\r\n")
    version, _, rest = status_line.partition(b" ")
    code = rest[:3]
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or not code.isdigit() or code < b"100" or rest[3:4] not in (b"", b" "):
        raise UpstreamError("RemoteProtocolError", f"not an HTTP/1.1 status line: {status_line[:60]!r}")
    fields = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise UpstreamError("RemoteProtocolError", f"not a header line: {line[:60]!r}")
        fields.append((name.decode("ascii").lower(), value.strip(b" \t").decode("latin-1")))
    return int(code), fields, version


class _Dechunker:
    """A chunked body's data (RFC 9112 7.1), from its bytes as they arrive; chunk extensions and trailers are
    read and dropped, each framing line at most :data:`HEAD_MAX_BYTES`."""

    def __init__(self) -> None:
        self._line = bytearray()  # a chunk-size or trailer line, until its CRLF
        self._left = 0  # data bytes of the current chunk still to come
        self._crlf = 0  # bytes of the CRLF after a chunk's data still to come
        self._trailers = False
        self.done = False
        self.extra = False  # bytes came after the last chunk

    def feed(self, raw: bytes) -> bytes:
        data = []
        position, end = 0, len(raw)
        while position < end:
            if self.done:
                self.extra = True
                break
            if self._left:
                taken = raw[position : position + self._left]
                data.append(taken)
                self._left -= len(taken)
                position += len(taken)
                self._crlf = 0 if self._left else 2
            elif self._crlf:
                if raw[position : position + 1] != b"\r\n"[2 - self._crlf : 3 - self._crlf]:
                    raise UpstreamError("RemoteProtocolError", "a chunk does not end where its size says")
                self._crlf -= 1
                position += 1
            else:
                newline = raw.find(b"\n", position)
                stop = end if newline < 0 else newline + 1
                self._line += raw[position:stop]
                position = stop
                if len(self._line) > HEAD_MAX_BYTES:
                    raise UpstreamError(
                        "RemoteProtocolError", f"a chunk-size or trailer line is longer than {HEAD_MAX_BYTES} bytes"
                    )
                if newline >= 0:
                    self._framing(bytes(self._line))
                    self._line.clear()
        return b"".join(data)

    def _framing(self, line: bytes) -> None:
        if self._trailers:  # the trailers end with an empty line
            self.done = line in (b"\r\n", b"\n")
            return
        size = line.split(b";", 1)[0].strip(b" \t\r\n")
        if _CHUNK_SIZE.fullmatch(size) is None:
            raise UpstreamError("RemoteProtocolError", f"not a chunk size: {line[:40]!r}")
        self._left = int(size, 16)
        self._trailers = self._left == 0


def _said(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
