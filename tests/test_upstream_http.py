"""The proxy's HTTP/1.1 client to the engine, against servers on loopback that send exactly the bytes given:
kept connections, every body framing, an engine that closes a kept connection, answers that break HTTP, TLS."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from harness.support import running_sidecar, serve_app
from mla_watch.server.upstream_http import HEAD_MAX_BYTES, UpstreamClient, UpstreamError

Script = Callable[[socket.socket, int], None]  # one accepted connection, and how many came before it


def read_request(connection: socket.socket) -> bytes:
    """One request's head and body off ``connection`` (b"" once the client closed it)."""
    received = b""
    while b"\r\n\r\n" not in received:
        piece = connection.recv(65536)
        if not piece:
            return b""
        received += piece
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    while len(body) < length:
        body += connection.recv(65536)
    return head + b"\r\n\r\n" + body


@contextmanager
def raw_server(script: Script) -> Iterator[str]:
    """A TCP server on loopback running ``script`` on each connection, one after the other; yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop, accepted = threading.Event(), [0]

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            connection.settimeout(10)
            with connection, suppress(OSError):
                script(connection, accepted[0])
            accepted[0] += 1

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def answers(*payloads: bytes | list[bytes], log: list[bytes] | None = None) -> Script:
    """Answer the requests of each connection with ``payloads`` in turn (a list: written piece by piece)."""

    def script(connection: socket.socket, index: int) -> None:
        for payload in payloads:
            request = read_request(connection)
            if not request:
                return
            if log is not None:
                log.append(request)
            for piece in payload if isinstance(payload, list) else [payload]:
                connection.sendall(piece)
                time.sleep(0.01)

    return script


def fetch(client: UpstreamClient, path: str = "/v1/completions", body: bytes = b"{}") -> tuple[int, bytes]:
    async def exchange() -> tuple[int, bytes]:
        try:
            async with await client.send(
                "POST", path, headers={"Content-Type": "application/json"}, body=body
            ) as answer:
                return answer.status_code, b"".join([piece async for piece in answer.aiter_raw()])
        finally:
            await client.aclose()

    return asyncio.run(exchange())


def test_requests_share_a_kept_connection_and_every_framing_of_an_answer_is_read() -> None:
    chunked = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhel",
        b"lo\r",
        b"\n6\r\n worl",
        b"d\r\n0\r\nX-Trailer: t\r\n\r\n",
    ]
    connections: list[int] = []

    def script(connection: socket.socket, index: int) -> None:
        connections.append(index)
        answers(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
            chunked,
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx",
            b"HTTP/1.0 200 OK\r\n\r\nuntil the end",
        )(connection, index)

    with raw_server(script) as url:

        async def scenario() -> list[tuple[int, bytes]]:
            client = UpstreamClient(url, connect_timeout=5)
            got = []
            for _ in range(6):
                async with await client.send("POST", "/v1/completions", headers={}, body=b"{}") as answer:
                    got.append((answer.status_code, b"".join([piece async for piece in answer.aiter_raw()])))
            await client.aclose()
            return got

        got = asyncio.run(scenario())
    assert got == [(200, b"{}"), (200, b"hello world"), (204, b""), (200, b"x"), (200, b"until the end"), (200, b"{}")]
    assert connections == [0, 1]  # five answers on the first connection; the one read to its close ends it


def test_a_kept_connection_the_engine_closed_is_retried_once_on_a_new_one() -> None:
    sent: list[bytes] = []

    def script(connection: socket.socket, index: int) -> None:
        if index == 0:  # answers one request, then closes as the second arrives: its keep-alive ran out
            answers(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\na", log=sent)(connection, index)
            read_request(connection)
        else:
            answers(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nb", log=sent)(connection, index)

    with raw_server(script) as url:

        async def scenario() -> list[bytes]:
            client = UpstreamClient(url, connect_timeout=5)
            bodies = []
            for _ in range(2):
                async with await client.send("POST", "/x", headers={}, body=b"{}") as answer:
                    bodies.append(b"".join([piece async for piece in answer.aiter_raw()]))
            return bodies

        assert asyncio.run(scenario()) == [b"a", b"b"]
    assert len(sent) == 2  # the request the closing connection took was never answered: sent once more, answered


def test_a_new_connection_closed_without_an_answer_is_not_sent_again() -> None:
    sent: list[bytes] = []

    def script(connection: socket.socket, index: int) -> None:
        sent.append(read_request(connection))

    with raw_server(script) as url, pytest.raises(UpstreamError) as failed:
        fetch(UpstreamClient(url, connect_timeout=5))
    assert failed.value.kind == "RemoteProtocolError" and "without an answer" in str(failed.value)
    assert len(sent) == 1


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * (HEAD_MAX_BYTES + 1) + b"\r\n\r\n", "longer than"),
        (b"HTTP/2 200 OK\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n", "not an HTTP/1.1 status line"),
        (b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n", "not a header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "is not a length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "only chunked"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "not a chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n", "does not end where its size says"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", "middle of a chunked answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "short of its Content-Length 10"),
    ],
)
def test_an_answer_that_breaks_http_is_an_error_naming_what(answer, said) -> None:
    with raw_server(answers(answer)) as url, pytest.raises(UpstreamError) as failed:
        fetch(UpstreamClient(url, connect_timeout=5))
    assert failed.value.kind == "RemoteProtocolError" and said in str(failed.value)


def test_a_header_value_that_would_split_the_request_is_refused_before_sending() -> None:
    client = UpstreamClient("http://127.0.0.1:9", connect_timeout=5)

    async def send() -> None:
        await client.send("POST", "/x", headers={"X-Task": "code\r\nX-Injected: 1"}, body=b"{}")

    with pytest.raises(UpstreamError) as failed:
        asyncio.run(send())
    assert failed.value.kind == "LocalProtocolError" and "X-Task" in str(failed.value)


def test_the_proxy_answers_a_broken_engine_with_a_502_naming_it(tmp_path) -> None:
    with (
        raw_server(answers(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")) as engine,
        running_sidecar(upstream=engine, rules=None, window_tokens=None, request_timeout=5, state_dir=tmp_path) as (
            url,
            _,
        ),
    ):
        answer = httpx.post(
            url + "/v1/completions", json={"prompt": "x"}, timeout=30, headers={"X-Business-Line": "code_assistant"}
        )
    error = answer.json()["error"]
    assert answer.status_code == 502 and error["code"] == "upstream_error"
    assert error["message"].startswith(f"upstream {engine} failed: RemoteProtocolError: ")


# ---------------------------------------------------------------------- TLS
def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, as files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


def tls_engine(cert_file: Path, key_file: Path) -> AbstractContextManager[str]:
    async def complete(request: Request) -> JSONResponse:
        return JSONResponse({"echo": await request.json()})

    return serve_app(
        Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])]), tls=(cert_file, key_file)
    )


def test_an_https_engine_is_reached_with_the_certificates_httpx_trusts(tmp_path, monkeypatch) -> None:
    cert_file, key_file = self_signed(tmp_path)
    with tls_engine(cert_file, key_file) as url:
        with pytest.raises(UpstreamError) as untrusted:  # certifi's authorities do not know it
            fetch(UpstreamClient(url, connect_timeout=5))
        assert untrusted.value.kind == "ConnectError" and "CERTIFICATE_VERIFY_FAILED" in str(untrusted.value)
        monkeypatch.setenv("SSL_CERT_FILE", str(cert_file))  # as for httpx: the authorities to trust
        status, body = fetch(UpstreamClient(url, connect_timeout=5), body=b'{"prompt": "x"}')
    assert status == 200 and json.loads(body) == {"echo": {"prompt": "x"}}
