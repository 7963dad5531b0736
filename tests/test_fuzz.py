"""Fuzzing what clients send (issue 7): HTTP bodies and headers, SDP offers, data-channel messages.

Hypothesis drives plain (sync) tests; the servers run on an event loop in a thread of their own,
so every case reaches them over real sockets on 127.0.0.1, as a client would. Every case must
hold:

- never a 5xx; every 4xx carries the JSON error shape ``{"error": {"code", "message"}}`` and,
  where the contract fixes them, the status and code the input calls for (the oracles below);
- nothing logged at ERROR by the server (a handler that raised, a task that failed), and no
  traceback logged by aiortc (an exception that escaped into its receive loop);
- ``/healthz`` answers 200 after each case; every offer answered is torn down with DELETE, and
  no session is left over or pending afterwards;
- over one real call, each fuzzed data-channel message gets its ``error`` event (or acts, when
  valid), and the call still speaks and sends video afterwards.

The default run is about 240 cases (well under a minute); ``-m slow`` runs 5,000. Requests that
are not HTTP (control bytes in a header, a Content-Encoding aiohttp cannot decode) are turned
away by aiohttp's parser before any route or middleware runs, with a text/plain 400: they are
left out here (see HEADER_BYTES).

The bugs the fuzzing found are pinned by the plain regression tests at the end of the file.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import ipaddress
import json
import logging
import re
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.client import CallClient, make_offer
from rtc_server.app import SessionManager
from rtc_server.engine_factory import EngineFactory
from signaling.access import TokenSigner
from signaling.errors import SignalingError
from signaling.messages import max_message_chars, parse_client_event, parse_text
from tests.conftest import LiveServer, start_server
from tests.reliability import trials
from tests.waiting import wait_until

T = TypeVar("T")

# Hypothesis warns when the global ``random`` changes while it draws an example: here that is
# aiortc and aioice, on the server's thread, not the strategies.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
    pytest.mark.filterwarnings("ignore:Generating overly large repr"),  # 60 kB messages
]

KEY = "fuzz-api-key-0123456789-abcdefghijk"
ALLOWED = "http://host.example:9000"
MAX_BODY = 64 * 1024
MAX_CHARS = 2000
MAX_TTL = 3600
SNAKE = re.compile(r"[a-z][a-z0-9_]*")


# -- the servers, on a loop of their own ------------------------------------------------------


class LoopThread:
    """An event loop in a thread of its own: the servers, and the callers of the call tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop")
        self._thread.daemon = True
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_the_rest() -> None:
            # Connections aiohttp still lingers on (bodies it reads out after a refusal).
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_the_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class Target:
    """One live server as the fuzzing client sees it."""

    live: LiveServer
    port: int
    guarded: bool
    """Started with an API key: /offer and the session routes need a token."""
    signer: TokenSigner | None = None
    tokens: dict[str, str] = field(default_factory=dict)
    """name -> token: valid, expired, foreign (another key's), scoped (avatar "alice")."""

    @property
    def manager(self) -> SessionManager:
        return self.live.manager

    @property
    def own_origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def servers(
    loop_thread: LoopThread, engine_factory: EngineFactory, cache_dir: Path
) -> Iterator[dict[str, Target]]:
    """One server without auth and one with, both with an allowed origin, no rate limit."""
    targets: dict[str, Target] = {}
    runners = []
    for name, extra in (("open", {}), ("guarded", {"api_key": KEY})):
        live, runner = loop_thread.run(
            start_server(
                engine_factory,
                cache_dir,
                rate_limit_per_min=0,
                allowed_origins=(ALLOWED,),
                **extra,
            )
        )
        runners.append(runner)
        targets[name] = Target(live, int(live.url.rsplit(":", 1)[1]), guarded=bool(extra))
    signer = TokenSigner(KEY)
    guarded = targets["guarded"]
    guarded.signer = signer
    guarded.tokens = {
        "valid": signer.mint(ttl_s=3000),
        "expired": signer.mint(ttl_s=1, now=time.time() - 60),
        "foreign": TokenSigner("another-key").mint(ttl_s=3000),
        "scoped": signer.mint(ttl_s=3000, avatar="alice"),
    }
    try:
        yield targets
    finally:
        for runner in runners:
            loop_thread.run(runner.cleanup())


BASE_OFFERS: dict[str, str] = {}
"""Real aiortc offers, made once per module: name -> SDP (read by the strategies as they draw)."""


@pytest.fixture(scope="module")
def base_offers(loop_thread: LoopThread, servers: dict[str, Target]) -> dict[str, str]:
    async def offers() -> dict[str, str]:
        return {
            "audio+video": await make_offer(),
            "audio": await make_offer(video=False),
            "video": await make_offer(audio=False),
        }

    BASE_OFFERS.update(loop_thread.run(offers()))
    return BASE_OFFERS


class ErrorLog(logging.Handler):
    """What the server logged that a fuzzed input must never cause."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if record.name == "aiohttp.server" and isinstance(
            exc, HttpProcessingError | RequestPayloadError
        ):
            # aiohttp's own parser on a body it could not decode, after our 400 went out
            # (see test_gzip_claimed_on_plain_bytes_is_400).
            return
        message = record.getMessage()
        # aiortc logs an exception that ended its DTLS receive loop as a warning with the
        # traceback in the text.
        if record.levelno >= logging.ERROR or "Traceback" in message:
            self.records.append(f"{record.name}: {message} {exc!r}")

    def take(self) -> list[str]:
        records, self.records = self.records, []
        return records


@pytest.fixture
def error_log() -> Iterator[ErrorLog]:
    handler = ErrorLog()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ],
    )


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """``one_of`` with weights (``one_of`` itself drops a branch given twice)."""
    branches = [strategy for n, strategy in choices for _ in range(n)]
    return st.sampled_from(range(len(branches))).flatmap(lambda i: branches[i])


# -- a raw HTTP client --------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def send(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[str, bytes]] | None = None,
    *,
    chunked: bool = False,
    host: bytes | None = None,
) -> Reply:
    """One request on a fresh connection, headers and body exactly as given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host=host is not None, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        for name, value in headers or []:
            conn.putheader(name, value)
        if chunked:
            conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            if body:
                conn.send(b"%x\r\n%s\r\n" % (len(body), body))
            conn.send(b"0\r\n\r\n")
        else:
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            conn.send(body)
        resp = conn.getresponse()
        return Reply(resp.status, resp.headers.get_content_type(), resp.read())
    finally:
        conn.close()


JSON = [("Content-Type", b"application/json")]

RESET = 0
"""Status of a request the server refused and reset before it was fully sent."""


def assert_error_shape(reply: Reply) -> str:
    """The JSON error shape of every route; returns the code."""
    assert reply.content_type == "application/json", (reply.status, reply.body[:200])
    body = reply.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"code", "message"}, body
    assert isinstance(error["code"], str) and SNAKE.fullmatch(error["code"]), body
    assert isinstance(error["message"], str) and error["message"], body
    return str(error["code"])


def outcome(reply: Reply) -> tuple[int, str | None]:
    """(status, error code or None); fails on a 5xx or a 4xx without the error shape."""
    assert reply.status < 500, (reply.status, reply.body[:300])
    if reply.status >= 400:
        return reply.status, assert_error_shape(reply)
    return reply.status, None


def assert_healthy(target: Target, log: ErrorLog) -> None:
    reply = send(target.port, "GET", "/healthz")
    assert reply.status == 200, reply
    assert log.take() == []


def left_clean(target: Target, log: ErrorLog) -> None:
    """Healthy, no error logged, and no session or offer in progress left behind."""
    assert_healthy(target, log)
    assert not target.manager.sessions, "a session outlived its case"
    assert target.manager._pending == 0


# -- strategies: JSON, bodies and headers -----------------------------------------------------

surrogates = st.characters(categories=["Cs"])
odd_text = st.one_of(
    st.text(max_size=30),
    st.text(alphabet=st.one_of(st.characters(), surrogates), max_size=12),
    st.sampled_from(
        ["", " ", "\t\n", "\x00", "offer", "answer", "say", "text", "interrupt", "null"]
        + ["\ud800", "\udfff x", "\U0001f600", "\u202eabc", "\ufeff", "a" * 2001, "é" * 2000]
    ),
)
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(),
    st.sampled_from([0, -1, 1, 300, 3600, 3601, 2**31, 2**63, -(2**63), 1e308, 10**300, 0.5]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, odd_text)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(odd_text, inner, max_size=4)
    ),
    max_leaves=10,
)


@st.composite
def encode(draw: st.DrawFn, value: object) -> bytes:
    """``value`` as JSON bytes, in one of many spellings (some of them not JSON any more)."""
    style = draw(
        st.sampled_from(
            ["ascii", "ascii", "unicode", "indent", "utf-16", "utf-32", "utf-8-sig", "latin-1"]
            + ["truncated", "trailing"]
        )
    )
    text = json.dumps(value, ensure_ascii=style == "ascii", indent=2 if style == "indent" else None)
    if style in ("utf-16", "utf-32"):
        return text.encode(style, "surrogatepass")
    if style == "latin-1":
        return text.encode("latin-1", "replace")
    data = text.encode("utf-8", "surrogatepass")  # lone surrogates: not UTF-8 any more
    if style == "utf-8-sig":
        return b"\xef\xbb\xbf" + data
    if style == "truncated":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if style == "trailing":
        return data + draw(st.sampled_from([b" ", b"x", b"\x00", b"}", b"\n{}", b"\xff"]))
    return data


@st.composite
def odd_documents(draw: st.DrawFn, key: str) -> bytes:
    """Huge or odd JSON: deep nesting, long numbers, many or repeated keys, long strings."""
    kind = draw(
        st.sampled_from(
            ["nested-array", "nested-object", "open-array", "huge-int", "long-float"]
            + ["many-keys", "duplicate-keys", "long-string", "empty", "whitespace", "nan"]
        )
    )
    n = draw(st.integers(1, 40_000))
    if kind == "nested-array":
        return b"[" * (n // 2) + b"]" * (n // 2)
    if kind == "nested-object":
        depth = n // 8
        return b'{"a":' * depth + b"1" + b"}" * depth
    if kind == "open-array":
        return b'{"' + key.encode() + b'": ' + b"[" * n
    if kind == "huge-int":
        return b'{"' + key.encode() + b'": ' + b"9" * (4000 + n) + b"}"
    if kind == "long-float":
        return b'{"' + key.encode() + b'": 1.' + b"5" * n + b"e99999}"
    if kind == "many-keys":
        return json.dumps({f"k{i}": i for i in range(n // 10)} | {key: "x"}).encode()
    if kind == "duplicate-keys":
        return (
            b'{"' + key.encode() + b'": 1, "type": "offer", "' + key.encode() + b'": "hi", '
            b'"type": 5, "interrupt": true, "interrupt": "no"}'
        )
    if kind == "long-string":
        return json.dumps({key: "a" * (n * 2)}).encode()
    if kind == "nan":
        return b'{"' + key.encode() + b'": NaN, "ttl_s": Infinity, "interrupt": -Infinity}'
    return b"" if kind == "empty" else b" \r\n\t "


@st.composite
def objects(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    """JSON objects with the endpoint's fields (each there 4 times in 5, of any type) and, at
    times, junk fields."""
    value: dict[str, Any] = {}
    # Hypothesis favours small numbers: 0 is the common case here.
    if draw(st.integers(0, 2)) == 2:
        value.update(draw(st.dictionaries(odd_text, json_values, max_size=3)))
    for name, strategy in fields.items():
        if draw(st.integers(0, 4)) < 4:
            value[name] = draw(strategy)
    return value


@st.composite
def near_limit(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]]) -> bytes:
    """A JSON object padded to a size at, around or well past the 64 KiB body limit."""
    value = draw(objects(fields))
    size = draw(st.one_of(st.integers(MAX_BODY - 3, MAX_BODY + 3), st.integers(1, 3 * MAX_BODY)))
    base = json.dumps({**value, "pad": ""}).encode()
    return json.dumps({**value, "pad": "x" * max(0, size - len(base))}).encode()


def bodies(fields: dict[str, st.SearchStrategy[Any]], key: str) -> st.SearchStrategy[bytes]:
    """Mostly JSON objects with the endpoint's fields; also any JSON, bytes, odd documents."""
    return weighted(
        (3, objects(fields).map(lambda v: json.dumps(v).encode())),
        (3, objects(fields).flatmap(encode)),
        (1, json_values.flatmap(encode)),
        (1, st.binary(max_size=300)),
        (1, odd_documents(key)),
        (1, near_limit(fields)),
    )


# Header values as HTTP allows them (RFC 9110: visible ASCII, obs-text, space, tab). Control
# bytes are not HTTP: aiohttp's parser refuses them itself, before any route runs.
HEADER_BYTES = [0x09, *range(0x20, 0x7F), *range(0x80, 0x100)]
header_values = st.lists(st.sampled_from(HEADER_BYTES), max_size=60).map(bytes)
TCHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
RESERVED = {
    "content-length",
    "transfer-encoding",
    "content-encoding",
    "host",
    "expect",
    "connection",
    "upgrade",
    "authorization",
    "origin",
    "content-type",
    "te",
    "trailer",
}
junk_headers = st.lists(
    st.tuples(
        st.text(alphabet=TCHARS, min_size=1, max_size=16).filter(
            lambda n: n.lower() not in RESERVED
        ),
        header_values,
    ),
    max_size=3,
)
# JSON most of the time, so that most cases reach the handlers' own checks.
content_types = weighted(
    (6, st.just(b"application/json")),
    (1, st.none()),
    (
        2,
        st.sampled_from(
            [
                b"application/json",
                b"application/json; charset=utf-8",
                b"application/json; charset=latin-1",
                b"text/plain",
                b"application/x-www-form-urlencoded",
                b"multipart/form-data; boundary=xyz",
                b"application/octet-stream",
                b"",
                b"*/*",
                b"application/json; charset=\xff",
                b" Application/JSON ",
                b"application/jsonx",
                b"text/json",
            ]
        ),
    ),
    (1, header_values),
)
# How the body travels: as is, compressed (gzip, deflate), or claimed compressed but not.
encodings = st.sampled_from(
    [None] * 16 + ["gzip", "deflate", "identity", "x-junk", "gzip-claimed", "deflate-claimed"]
)
auth_prefixes = st.sampled_from(
    [b"Bearer "] * 6 + [b"bearer ", b"BEARER   ", b"Bearer\t", b"Basic ", b"Token ", b""]
)
auth_suffixes = weighted(
    (2, st.just(b"")),
    (1, st.sampled_from([b"\xff", "é".encode(), b" ", b"  \t", b"x", b".", b"=="])),
    (1, header_values),
)


def auths(favourite: str) -> st.SearchStrategy[tuple[str, bytes, bytes]]:
    """(what, prefix, suffix): the secret of ``what`` between the two, or (raw, b"", value)."""
    return weighted(
        (3, st.tuples(st.just(favourite), auth_prefixes, auth_suffixes)),
        (
            2,
            st.tuples(
                st.sampled_from(["key", "valid", "expired", "foreign", "scoped"]),
                auth_prefixes,
                auth_suffixes,
            ),
        ),
        (1, st.just(("none", b"", b""))),
        (1, st.tuples(st.just("raw"), auth_prefixes, header_values)),
    )


# (what, value): none, own (the server's own origin), allowed, or raw bytes.
origins = weighted(
    (6, st.just(("none", b""))),
    (2, st.tuples(st.sampled_from(["own", "allowed"]), st.sampled_from([b"", b" ", b"\t"]))),
    (
        2,
        st.tuples(
            st.just("raw"),
            st.one_of(
                st.sampled_from(
                    [
                        b"null",
                        b"*",
                        b"http://evil.example",
                        b"HTTP://HOST.EXAMPLE:9000",
                        ALLOWED.encode() + b"/",
                        ALLOWED.encode() + b"\xff",
                        b"http://host.example:90000",
                        b"file://",
                        b"http://127.0.0.1",
                    ]
                ),
                header_values,
            ),
        ),
    ),
)
hosts = weighted(
    (8, st.just(None)),
    (
        1,
        st.sampled_from(
            [b"", b"evil.example", b"\xff\xfe", b"a" * 300, b"[::1]:1", b"host.example:9000"]
        ),
    ),
)


@dataclass
class Request:
    """One fuzzed request: body and headers, before they meet a server."""

    body: bytes
    content_type: bytes | None
    encoding: str | None
    chunked: bool
    auth: tuple[str, bytes, bytes]
    origin: tuple[str, bytes]
    host: bytes | None
    junk: list[tuple[str, bytes]]

    def wire_body(self) -> bytes:
        if self.encoding == "gzip":
            return gzip.compress(self.body, mtime=0)
        if self.encoding == "deflate":
            return zlib.compress(self.body)
        return self.body

    def chunked_on_wire(self) -> bool:
        # An empty chunked body and an empty Content-Length body differ only in framing.
        return self.chunked and bool(self.wire_body())

    def auth_header(self, target: Target) -> bytes | None:
        what, prefix, suffix = self.auth
        if what == "none":
            return None
        if what == "raw":
            return prefix + suffix
        secret = KEY if what == "key" else target.tokens.get(what, f"no-{what}-token")
        return prefix + secret.encode() + suffix

    def own_origin(self, target: Target) -> str:
        if self.host is None:
            return target.own_origin
        return "http://" + header_text(self.host)

    def origin_header(self, target: Target) -> bytes | None:
        what, value = self.origin
        if what == "none":
            return None
        if what == "own":
            return self.own_origin(target).encode("utf-8", "surrogateescape") + value
        if what == "allowed":
            return value + ALLOWED.encode() + value
        return value

    def headers(self, target: Target) -> list[tuple[str, bytes]]:
        headers = list(self.junk)
        if self.content_type is not None:
            headers.append(("Content-Type", self.content_type))
        if self.encoding is not None:
            headers.append(("Content-Encoding", self.encoding.removesuffix("-claimed").encode()))
        for name, value in (
            ("Authorization", self.auth_header(target)),
            ("Origin", self.origin_header(target)),
        ):
            if value is not None:
                headers.append((name, value))
        return headers

    def send(self, target: Target, method: str, path: str) -> Reply:
        try:
            return send(
                target.port,
                method,
                path,
                self.wire_body(),
                self.headers(target),
                chunked=self.chunked_on_wire(),
                host=self.host,
            )
        except (ConnectionResetError, BrokenPipeError):
            # A body in an encoding the server refuses is answered (415) and the connection
            # closed without reading it; the rest of the body then meets a reset, which can
            # also take the answer with it. Only such requests may end this way.
            if self.encoding in (None, "identity"):
                raise
            return Reply(RESET, "", b"")


def requests(body: st.SearchStrategy[bytes], favourite: str) -> st.SearchStrategy[Request]:
    """``favourite``: the secret the Authorization header carries most often."""
    return st.builds(
        Request,
        body=body,
        content_type=content_types,
        encoding=encodings,
        chunked=st.integers(0, 3).map(lambda n: n == 3),
        auth=auths(favourite),
        origin=origins,
        host=hosts,
        junk=junk_headers,
    )


# -- oracles: what the contract says a request should get --------------------------------------

Expected = set[tuple[int, str | None]]
"""The outcomes allowed: (status, error code), code None for a success."""


def header_text(value: bytes) -> str:
    """A header value as aiohttp hands it over: outer whitespace gone, bytes as UTF-8."""
    return value.strip(b" \t").decode("utf-8", "surrogateescape")


def bearer_of(value: bytes | None) -> str | None:
    """The credential of ``Authorization: Bearer <credential>`` (scheme case-insensitive)."""
    if value is None:
        return None
    scheme, _, rest = header_text(value).partition(" ")
    return rest.strip() if scheme.lower() == "bearer" and rest.strip() else None


def host_refused(request: Request) -> bool:
    """A server on loopback answers only for localhost and IP literals (SECURITY.md)."""
    if request.host is None:
        return False  # http.client's own Host: 127.0.0.1:port
    name = header_text(request.host).lower()
    if name.startswith("["):
        name = name[1 : name.index("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return name != "localhost"
    return False


def origin_refused(request: Request, target: Target) -> bool:
    value = request.origin_header(target)
    if value is None:
        return False  # not a browser page: keys and tokens guard those
    origin = header_text(value)
    return origin not in (request.own_origin(target), ALLOWED)


def token_refusal(request: Request, target: Target) -> tuple[int, str] | None:
    """With auth on: why the request's token is refused, or None when it is a valid one."""
    credential = bearer_of(request.auth_header(target))
    if credential is None:
        return 401, "unauthorized"
    if credential in (target.tokens["valid"], target.tokens["scoped"]):
        return None
    if credential == target.tokens["expired"]:
        return 401, "token_expired"
    return 401, "bad_token"


def names_json(content_type: bytes | None) -> bool:
    """Whether the server reads a body of this Content-Type: JSON's alone, parameters aside."""
    if content_type is None:
        return False
    return header_text(content_type).split(";", 1)[0].strip().lower() == "application/json"


def decoded_body(request: Request) -> dict[str, Any] | tuple[int, str]:
    """The JSON object the handler reads, or the error it must answer."""
    wire = request.wire_body()
    if not request.chunked_on_wire() and len(wire) > MAX_BODY:
        return 413, "body_too_large"
    if request.encoding not in (None, "identity"):
        return 415, "unsupported_encoding"
    if not names_json(request.content_type):
        return 415, "unsupported_media_type"
    if len(request.body) > MAX_BODY:
        return 413, "body_too_large"
    try:
        value = json.loads(request.body)
    except (ValueError, RecursionError):
        return 400, "bad_json"
    if not isinstance(value, dict):
        return 400, "bad_json"
    return value


def text_refusal(value: dict[str, Any], field: str = "text") -> tuple[int, str] | None:
    """Why a say/text's text is refused (DECISIONS 'Limits')."""
    text = value.get(field)
    if not isinstance(text, str) or not text.strip():
        return 400, "bad_text"
    if len(text) > MAX_CHARS:
        return 413, "text_too_long"
    if any(ord(c) < 32 and c not in "\t\n\r" or 0x7F <= ord(c) <= 0x9F for c in text):
        return 400, "bad_text"  # control characters: no voice can speak them
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return 400, "bad_text"  # lone surrogates
    return None


OFFER_REFUSALS = {
    (400, code)
    for code in (
        "bad_sdp",
        "no_audio",
        "no_video",
        "bad_sections",
        "no_fingerprint",
        "no_ice_credentials",
        "no_candidates",
    )
}
"""What an offer that is not a real one may get (signaling.offer_rules)."""


def expect_offer(request: Request, target: Target) -> Expected:
    if host_refused(request):
        return {(421, "unknown_host")}
    if origin_refused(request, target):
        return {(403, "origin_not_allowed")}
    scope = None
    if target.guarded:
        refusal = token_refusal(request, target)
        if refusal is not None:
            return {refusal}
        credential = bearer_of(request.auth_header(target))
        scope = "alice" if credential == target.tokens["scoped"] else None
    value = decoded_body(request)
    if isinstance(value, tuple):
        return {value}
    sdp, avatar = value.get("sdp"), value.get("avatar")
    if not isinstance(sdp, str) or not sdp.strip() or value.get("type") != "offer":
        return {(400, "bad_offer")}
    if avatar is not None and not isinstance(avatar, str):
        return {(400, "bad_offer")}
    answerable: tuple[int, str | None]
    if scope is not None:  # this server serves one avatar: a scoped token opens nothing
        answerable = (401, "wrong_scope")
    elif avatar is not None:
        answerable = (400, "unknown_avatar")
    else:
        answerable = (200, None)
    kinds = next((name for name, base in BASE_OFFERS.items() if base == sdp), None)
    if kinds is None:  # aiortc's parser is lenient: junk around a real offer may pass
        return {*OFFER_REFUSALS, answerable}
    if kinds == "video":
        return {(400, "no_audio")}
    if kinds == "audio":
        return {(400, "no_video")}
    return {answerable}


def routable(session_id: str) -> bool:
    """Whether ``/sessions/{id}/say`` reaches the route (its pattern is ``[^{}/]+``)."""
    return bool(session_id) and not set(session_id) & set("{}/") and session_id not in (".", "..")


def expect_say(request: Request, target: Target, session_id: str | None) -> Expected:
    """``session_id`` None: the live call's."""
    if host_refused(request):
        return {(421, "unknown_host")}
    if origin_refused(request, target):
        return {(403, "origin_not_allowed")}
    if session_id is not None and not routable(session_id):
        return {(404, "not_found")}
    if target.guarded:
        # No session of the guarded server was opened with these tokens.
        return {token_refusal(request, target) or (401, "unauthorized")}
    value = decoded_body(request)
    if isinstance(value, tuple):
        return {value}
    refusal = text_refusal(value)
    if refusal is not None:
        return {refusal}
    if not isinstance(value.get("interrupt", False), bool):
        return {(400, "bad_interrupt")}
    return {(202, None)} if session_id is None else {(404, "unknown_session")}


def expect_token(request: Request, target: Target) -> Expected:
    if host_refused(request):
        return {(421, "unknown_host")}
    if origin_refused(request, target):
        return {(403, "origin_not_allowed")}
    if not target.guarded:
        return {(404, "auth_off")}
    if bearer_of(request.auth_header(target)) != KEY:
        return {(401, "unauthorized")}
    if not request.wire_body():
        value: Any = {}
    else:
        value = decoded_body(request)
        if isinstance(value, tuple):
            return {value}
    ttl = value.get("ttl_s", 300)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_TTL:
        return {(400, "bad_ttl")}
    if value.get("avatar") is not None:  # one avatar: no scopes to mint
        return {(400, "bad_avatar")}
    return {(200, None)}


def check(reply: Reply, expected: Expected, request: Request) -> tuple[int, str | None]:
    if reply.status == RESET:
        return RESET, None  # refused before its body was read: see Request.send
    if request.encoding in ("gzip-claimed", "deflate-claimed") and reply.content_type != (
        "application/json"
    ):
        # A body claimed compressed that is not: when aiohttp's parser fails on it in the same
        # read as the headers, it answers itself and no handler runs.
        assert (reply.status, reply.content_type) == (400, "text/plain"), reply
        return 400, None
    got = outcome(reply)
    assert got in expected, f"got {got}, expected one of {expected} for {request!r}"
    return got


# -- target: POST /offer bodies and headers -----------------------------------------------------

offer_fields: dict[str, st.SearchStrategy[Any]] = {
    "sdp": weighted(
        (1, json_values),
        (1, odd_text),
        (4, st.just("audio+video").map(lambda k: BASE_OFFERS[k])),
        (1, st.sampled_from(["audio", "video"]).map(lambda k: BASE_OFFERS[k])),
        (1, st.sampled_from(["audio+video", "audio"]).map(lambda k: BASE_OFFERS[k] + "\x00")),
    ),
    "type": weighted((3, st.just("offer")), (1, json_values)),
    "avatar": weighted((4, st.none()), (1, st.just("alice")), (1, json_values)),
}


def tear_down(target: Target, reply: Reply, request: Request | None) -> None:
    """DELETE the session an offer opened; it must go at once."""
    answer = reply.json()
    assert set(answer) == {"sdp", "type", "session_id", "resume"}, answer
    assert answer["type"] == "answer" and len(answer["resume"]) >= 32, answer
    assert "m=audio" in answer["sdp"] and "m=video" in answer["sdp"]
    session_id = answer["session_id"]
    # No check that it is still there: a call whose ICE cannot succeed may already have ended
    # by itself (its DELETE is then a 404, below).
    auth = request.auth_header(target) if request is not None else None
    headers = [("Authorization", auth)] if auth is not None else []
    deleted = send(target.port, "DELETE", f"/sessions/{session_id}", headers=headers)
    if deleted.status == 404:
        # The call ended by itself first (an offer whose ICE cannot succeed fails at once):
        # then the server must have forgotten it, and say so.
        assert session_id not in target.manager.sessions, deleted
        assert b'"unknown_session"' in deleted.body, deleted
        return
    assert deleted.status == 204, deleted
    assert session_id not in target.manager.sessions


def fuzz_offer_body(servers: dict[str, Target], log: ErrorLog, examples: int) -> None:
    seen: Counter[tuple[int, str | None]] = Counter()
    start = time.monotonic()

    with trials(
        "fuzzed POST /offer bodies and headers",
        area="input",
        note="auth on and off; no 5xx, JSON error shape, status per contract, no session left",
    ) as t:

        @fuzz_settings(examples)
        @given(guarded=st.booleans(), request=requests(bodies(offer_fields, "sdp"), "valid"))
        def case(guarded: bool, request: Request) -> None:
            with t.trial():
                target = servers["guarded" if guarded else "open"]
                reply = request.send(target, "POST", "/offer")
                try:
                    got = check(reply, expect_offer(request, target), request)
                    seen[got] += 1
                finally:
                    if reply.status == 200:
                        tear_down(target, reply, request)
                left_clean(target, log)

        case()
        finish(servers, log)
        t.figures = summary(seen, answered=seen[(200, None)], s=round(time.monotonic() - start, 1))


Figures = dict[str, float | int | str]


def summary(seen: Counter[tuple[int, str | None]], **figures: float | int | str) -> Figures:
    """The figures of a record: ``figures``, then how many answers of each status."""
    by_status: Counter[int] = Counter()
    for (status, _), n in seen.items():
        by_status[status] += n
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(by_status.items()))
    return {**figures, "statuses": statuses}


def finish(servers: dict[str, Target], log: ErrorLog) -> None:
    for target in servers.values():
        left_clean(target, log)


def test_fuzz_offer_body(
    servers: dict[str, Target], base_offers: dict[str, str], error_log: ErrorLog
) -> None:
    fuzz_offer_body(servers, error_log, 50)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fuzz_offer_body_slow(
    servers: dict[str, Target], base_offers: dict[str, str], error_log: ErrorLog
) -> None:
    fuzz_offer_body(servers, error_log, 1500)


# -- target: POST /token -----------------------------------------------------------------------

token_fields: dict[str, st.SearchStrategy[Any]] = {
    "ttl_s": st.one_of(st.integers(-5, MAX_TTL + 5), numbers, json_values),
    "avatar": st.one_of(st.just("alice"), odd_text, json_values),
}


def fuzz_token(servers: dict[str, Target], log: ErrorLog, examples: int) -> None:
    seen: Counter[tuple[int, str | None]] = Counter()
    start = time.monotonic()

    with trials(
        "fuzzed POST /token",
        area="input",
        note="auth on and off; keys and tokens in odd Authorization headers, odd Origins",
    ) as t:

        @fuzz_settings(examples)
        @given(guarded=st.booleans(), request=requests(bodies(token_fields, "ttl_s"), "key"))
        def case(guarded: bool, request: Request) -> None:
            with t.trial():
                target = servers["guarded" if guarded else "open"]
                reply = request.send(target, "POST", "/token")
                got = check(reply, expect_token(request, target), request)
                seen[got] += 1
                if got[0] == 200:
                    minted = reply.json()
                    assert set(minted) == {"token", "expires_in"}, minted
                    assert target.signer is not None
                    grant = target.signer.verify(minted["token"])
                    assert abs(grant.expires_at - time.time() - minted["expires_in"]) < 5
                    body = json.loads(request.body) if request.body else {}
                    assert grant.avatar == body.get("avatar")
                assert_healthy(target, log)

        case()
        finish(servers, log)
        t.figures = summary(seen, minted=seen[(200, None)], s=round(time.monotonic() - start, 1))


def test_fuzz_token(servers: dict[str, Target], error_log: ErrorLog) -> None:
    fuzz_token(servers, error_log, 50)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fuzz_token_slow(servers: dict[str, Target], error_log: ErrorLog) -> None:
    fuzz_token(servers, error_log, 1000)


# -- target: POST /sessions/{id}/say -----------------------------------------------------------

# Text a voice speaks in a moment. Random Unicode is spelled out character by character: 2,000
# random characters are minutes of speech (see test_long_say_is_interruptible), so texts that
# pass go to the real call only when they are short and wordy.
SPEAKABLE = list("abcdefghijklmnopqrstuvwxyz     ,.!?'") + ["é", "ß", "你", "😀", "\u200b", "ا"]
speakable = st.text(alphabet=st.sampled_from(SPEAKABLE), min_size=1, max_size=24).filter(
    lambda t: bool(t.strip())
)
refused_text = st.one_of(  # the likeliest first: hypothesis favours early branches
    speakable.map(lambda t: t + "\x00"),
    speakable.map(lambda t: "\ud800" + t),
    st.integers(MAX_CHARS + 1, 3 * MAX_CHARS).map(lambda n: "a" * n),
    st.text(alphabet=" \t\n\r\x0b\x0c\x85\u3000\u2028", max_size=5),
    st.integers(MAX_CHARS + 1, MAX_CHARS + 50).map(lambda n: "😀" * n),
    st.none(),
    st.booleans(),
    numbers,
    st.lists(scalars, max_size=3),
    st.dictionaries(odd_text, scalars, max_size=2),
)
say_fields_real: dict[str, st.SearchStrategy[Any]] = {
    "text": weighted((2, speakable), (1, refused_text)),
    "interrupt": weighted((3, st.booleans()), (1, json_values)),
}
say_fields_any: dict[str, st.SearchStrategy[Any]] = {
    "text": st.one_of(
        speakable,
        refused_text,
        odd_text,
        json_values,
        st.sampled_from(["a" * MAX_CHARS, "é" * MAX_CHARS, "😀" * MAX_CHARS]),
    ),
    "interrupt": st.one_of(st.booleans(), json_values),
}
# Session ids in the path: the live call's, or none that exists.
unknown_ids = st.one_of(
    st.text(
        alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="/"),
        min_size=1,
        max_size=60,
    ).filter(lambda t: t not in (".", "..")),
    st.sampled_from(["0" * 32, "f" * 32, "%", "%00", "null", "\x00", "..%2F", " ", "{", "a}"]),
)


@st.composite
def say_cases(draw: st.DrawFn) -> tuple[bool, str | None, Request]:
    """(guarded, an unknown session id or None for the live call's, request)."""
    guarded = draw(st.integers(0, 3)) == 3
    real = not guarded and not draw(st.booleans())
    request = draw(requests(bodies(say_fields_real if real else say_fields_any, "text"), "valid"))
    if real:
        value = decoded_body(request)
        if isinstance(value, dict) and text_refusal(value) is None and len(value["text"]) > 24:
            # Only short, wordy text reaches the voice (see SPEAKABLE).
            request.body = json.dumps({**value, "text": draw(speakable)}).encode()
    return guarded, None if real else draw(unknown_ids), request


def fuzz_say(
    loop_thread: LoopThread, servers: dict[str, Target], log: ErrorLog, examples: int
) -> None:
    seen: Counter[tuple[int, str | None]] = Counter()
    start = time.monotonic()
    target = servers["open"]
    caller = loop_thread.run(new_caller(target.live.url))
    session_id = loop_thread.run(connect(caller))

    with trials(
        "fuzzed POST /sessions/{id}/say",
        area="input",
        note="a live call and unknown ids, auth on and off; the call speaks afterwards",
    ) as t:

        @fuzz_settings(examples)
        @given(case=say_cases())
        def case(case: tuple[bool, str | None, Request]) -> None:
            with t.trial():
                guarded, unknown, request = case
                server = servers["guarded" if guarded else "open"]
                sid = session_id if unknown is None else unknown
                reply = request.send(server, "POST", f"/sessions/{quote(sid, safe='')}/say")
                got = check(reply, expect_say(request, server, unknown), request)
                seen[got] += 1
                if got[0] == 202:
                    answer = reply.json()
                    assert set(answer) == {"utterance_id"} and re.fullmatch(
                        r"[0-9a-f]{32}", answer["utterance_id"]
                    ), answer
                assert_healthy(server, log)
                assert list(target.manager.sessions) == [session_id]

        try:
            case()
            # The call took every say it was given: it still speaks.
            loop_thread.run(still_speaks(caller))
        finally:
            loop_thread.run(hang_up(caller))
        end_call(target, session_id)
        finish(servers, log)
        t.figures = summary(seen, spoken=seen[(202, None)], s=round(time.monotonic() - start, 1))


async def new_caller(url: str) -> CallClient:
    """A caller made on the loop that runs it (aiortc schedules tasks as it is built)."""
    return CallClient(url, record_video=False)


async def connect(caller: CallClient) -> str:
    session_id = await caller.connect()
    await caller.wait_channel_open()
    await caller.wait_state("listening")
    return session_id


async def still_speaks(caller: CallClient) -> None:
    """After the fuzzing: the call stops on interrupt, speaks a say, and video keeps coming."""
    caller.channel.send(json.dumps({"type": "interrupt"}))
    await asyncio.sleep(0.3)
    frames = len(caller.received.video)
    mark = len(caller.events)
    caller.channel.send(json.dumps({"type": "say", "text": "Still here after all that."}))
    await wait_until(
        lambda: {"type": "state", "state": "speaking"} in caller.events[mark:],
        20.0,
        lambda: f"no speaking state: {caller.events[mark:]}",
    )
    assert caller.pc.connectionState == "connected"
    await asyncio.sleep(1.0)
    assert len(caller.received.video) >= frames + 10, "video stopped"


async def hang_up(caller: CallClient) -> None:
    await caller.close()


def end_call(target: Target, session_id: str) -> None:
    """The call is gone: hung up (DTLS close) or, failing that, DELETEd."""
    deadline = time.monotonic() + 10
    while session_id in target.manager.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    if session_id in target.manager.sessions:
        send(target.port, "DELETE", f"/sessions/{session_id}")
    assert session_id not in target.manager.sessions


def test_fuzz_say(loop_thread: LoopThread, servers: dict[str, Target], error_log: ErrorLog) -> None:
    fuzz_say(loop_thread, servers, error_log, 40)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fuzz_say_slow(
    loop_thread: LoopThread, servers: dict[str, Target], error_log: ErrorLog
) -> None:
    fuzz_say(loop_thread, servers, error_log, 1000)


# -- target: SDP mutations of real offers ------------------------------------------------------

JUNK_LINES = [
    "a=rtpmap:abc",
    "a=rtpmap:96 VP8/-1",
    "a=rtpmap:111 opus/48000/0",
    "a=rtpmap:99 H264/0",
    "a=fmtp:",
    "a=fmtp:99 profile-level-id=zz;packetization-mode=9",
    "a=fmtp:111 minptime=abc;useinbandfec=x",
    "a=ssrc:abc cname:x",
    "a=ssrc:1",
    "a=ssrc-group:FID 1",
    "a=ssrc-group:FID",
    "a=extmap:999 urn:x",
    "a=extmap:abc",
    "a=extmap:1/junk urn:ietf:params:rtp-hdrext:sdes:mid",
    "a=rtcp-fb:96",
    "a=rtcp-fb:* nack",
    "a=rtcp:abc",
    "a=rtcp:9 IN IP4",
    "a=candidate:junk",
    "a=candidate:1 1 udp 1 127.0.0.1 99999 typ host",
    "a=candidate:1 1 udp 1 ::1 9 typ host",
    "a=candidate:1 1 udp 1 foo.local 9 typ host",
    "a=candidate:1 1 udp 1 no.such.host.invalid 9 typ host",
    "a=candidate:1 1 tcp 1 127.0.0.1 9 typ host tcptype active",
    "a=candidate:1 1 udp 1 127.0.0.1 9 typ relay",
    "a=candidate:1 1 udp 1 127.0.0.1 9 typ srflx raddr x rport y",
    "a=candidate:1 2 udp 1 127.0.0.1 0 typ host",
    "a=end-of-candidates",
    "a=mid:",
    "a=mid:0",
    "a=msid:",
    "a=msid-semantic:",
    "a=sctp-port:-1",
    "a=sctp-port:abc",
    "a=max-message-size:abc",
    "a=max-message-size:-1",
    "a=setup:junk",
    "a=setup:",
    "a=ice-options:trickle x",
    "a=ice-lite",
    "a=rid:x send",
    "a=simulcast:send x",
    "a=sctpmap:5000 webrtc-datachannel 1024",
    "a=crypto:1 AES_CM_128_HMAC_SHA1_80 inline:x",
    "a=ptime:-1",
    "a=maxptime:abc",
    "a=rtcp-mux-only",
    "a=rtcp-rsize",
    "a=group:BUNDLE",
    "a=group:BUNDLE 0 0 0",
    "a=group:BUNDLE 7 8",
    "a=group:LS 0 1",
    "a=fingerprint:",
    "a=fingerprint:sha-256",
    "a=fingerprint:md5 00:11",
    "a=ice-pwd:",
    "a=ice-ufrag:",
    "a=sendrecv",
    "a=inactive",
    "b=AS:abc",
    "b=TIAS:-1",
    "i=x",
    "k=clear:x",
    "m=audio 9 UDP/TLS/RTP/SAVPF 111",
    "m=video 9 UDP/TLS/RTP/SAVPF",
    "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
    "m=",
    "m=audio",
    "m=audio x y z",
    "c=IN IP6 ::1",
    "c=IN IP4 999.0.0.1",
    "c=IN IP4",
    "c=",
    "v=1",
    "o=",
    "s=",
    "t=abc",
    "z=x",
    "x=junk",
    "=",
    "",
]


def _index(draw: st.DrawFn, lines: list[str]) -> int:
    return draw(st.integers(0, max(0, len(lines) - 1)))


def _matching(draw: st.DrawFn, lines: list[str], pattern: str) -> int | None:
    found = [i for i, line in enumerate(lines) if re.match(pattern, line)]
    return draw(st.sampled_from(found)) if found else None


def op_drop(draw: st.DrawFn, lines: list[str]) -> str:
    if lines:
        i = _index(draw, lines)
        return f"drop {lines.pop(i)!r}"
    return "drop nothing"


def op_duplicate(draw: st.DrawFn, lines: list[str]) -> str:
    if not lines:
        return "duplicate nothing"
    i = _index(draw, lines)
    lines.insert(i, lines[i])
    return f"duplicate {lines[i]!r}"


def op_swap(draw: st.DrawFn, lines: list[str]) -> str:
    if not lines:
        return "swap nothing"
    i, j = _index(draw, lines), _index(draw, lines)
    lines[i], lines[j] = lines[j], lines[i]
    return f"swap lines {i} and {j}"


def op_shuffle(draw: st.DrawFn, lines: list[str]) -> str:
    if not lines:
        return "shuffle nothing"
    i, j = sorted((_index(draw, lines), _index(draw, lines)))
    lines[i : j + 1] = draw(st.permutations(lines[i : j + 1]))
    return f"shuffle lines {i}..{j}"


def op_garble(draw: st.DrawFn, lines: list[str]) -> str:
    if not lines:
        return "garble nothing"
    i = _index(draw, lines)
    line = lines[i]
    at = draw(st.integers(0, len(line)))
    cut = draw(st.integers(0, 4))
    junk = draw(st.text(max_size=8))
    lines[i] = line[:at] + junk + line[at + cut :]
    return f"garble {line!r} into {lines[i]!r}"


def op_truncate(draw: st.DrawFn, lines: list[str]) -> str:
    text = "\r\n".join(lines)
    cut = draw(st.integers(0, len(text)))
    lines[:] = text[:cut].split("\r\n")
    return f"truncate at {cut}"


NUMBERS = ["0", "-1", "1", "65535", "65536", "4294967296", "99999999999999999999", "1e3", "x", ""]


def op_number(draw: st.DrawFn, lines: list[str]) -> str:
    spots = [(i, m.span()) for i, line in enumerate(lines) for m in re.finditer(r"\d+", line)]
    if not spots:
        return "no number"
    i, (a, b) = draw(st.sampled_from(spots))
    new = draw(st.one_of(st.sampled_from(NUMBERS), st.integers().map(str)))
    old = lines[i]
    lines[i] = old[:a] + new + old[b:]
    return f"number in {old!r} -> {new!r}"


def op_payload_types(draw: st.DrawFn, lines: list[str]) -> str:
    i = _matching(draw, lines, "m=")
    if i is None:
        return "no m-line"
    fields = lines[i].split(" ")
    types = draw(
        st.lists(
            st.one_of(st.integers(-5, 300).map(str), st.sampled_from(["", "abc", "96", "0"])),
            max_size=6,
        )
    )
    lines[i] = " ".join(fields[:3] + types)
    return f"payload types {lines[i]!r}"


def op_kind(draw: st.DrawFn, lines: list[str]) -> str:
    i = _matching(draw, lines, "m=")
    if i is None:
        return "no m-line"
    kind = draw(st.sampled_from(["audio", "video", "application", "text", "message", "", "AUDIO"]))
    lines[i] = re.sub(r"^m=\w*", f"m={kind}", lines[i])
    return f"kind {lines[i]!r}"


def op_direction(draw: st.DrawFn, lines: list[str]) -> str:
    new = draw(
        st.sampled_from(
            ["a=sendrecv", "a=recvonly", "a=sendonly", "a=inactive", "a=sendrecvx", "a="]
        )
    )
    i = _matching(draw, lines, "a=(sendrecv|recvonly|sendonly|inactive)$")
    if i is None or draw(st.booleans()):
        lines.insert(_index(draw, lines), new)
        return f"add {new!r}"
    lines[i] = new
    return f"direction {new!r}"


def op_fingerprint(draw: st.DrawFn, lines: list[str]) -> str:
    i = _matching(draw, lines, "a=fingerprint:")
    if i is None:
        return "no fingerprint"
    algorithm = draw(st.sampled_from(["sha-256", "sha-1", "sha-512", "md5", "", "SHA-256", "x"]))
    value = draw(
        st.one_of(
            st.sampled_from(["", "zz:zz", ":".join(["00"] * 32), ":".join(["FF"] * 64), "00"]),
            st.text(max_size=40),
        )
    )
    lines[i] = f"a=fingerprint:{algorithm} {value}"
    return f"fingerprint {lines[i]!r}"


def op_ice(draw: st.DrawFn, lines: list[str]) -> str:
    i = _matching(draw, lines, "a=ice-(ufrag|pwd):")
    if i is None:
        return "no ice credentials"
    name = lines[i].split(":", 1)[0]
    value = draw(
        st.one_of(st.sampled_from(["", " ", "a", "x" * 300, "é", "\x00"]), st.text(max_size=30))
    )
    lines[i] = f"{name}:{value}"
    return f"ice {lines[i]!r}"


def op_candidate(draw: st.DrawFn, lines: list[str]) -> str:
    i = _matching(draw, lines, "a=candidate:")
    if i is None:
        return "no candidate"
    fields = lines[i].split(" ")
    if len(fields) < 8:
        return "short candidate"
    spot = draw(st.sampled_from([1, 2, 3, 4, 5, 7]))
    fields[spot] = draw(
        st.one_of(
            st.sampled_from(
                ["::1", "0.0.0.0", "foo.local", "999.1.1.1", "localhost", "0", "70000", "-1"]
                + ["tcp", "TCP", "sctp", "relay", "srflx", "prflx", "", "x" * 200]
            ),
            st.text(max_size=12),
        )
    )
    lines[i] = " ".join(fields)
    return f"candidate {lines[i]!r}"


def op_junk(draw: st.DrawFn, lines: list[str]) -> str:
    junk = draw(
        st.one_of(
            st.sampled_from(JUNK_LINES),
            st.sampled_from(JUNK_LINES),
            st.text(max_size=40).map(lambda t: "a=" + t),
            st.text(max_size=40),
        )
    )
    lines.insert(_index(draw, lines), junk)
    return f"insert {junk!r}"


def op_huge_line(draw: st.DrawFn, lines: list[str]) -> str:
    size = draw(st.integers(1000, 70_000))
    prefix = draw(st.sampled_from(["a=x-huge:", "a=ice-ufrag:", "a=fmtp:96 ", "m=audio 9 ", ""]))
    lines.insert(_index(draw, lines), prefix + "y" * size)
    return f"insert a {size}-character {prefix!r} line"


def op_drop_section(draw: st.DrawFn, lines: list[str]) -> str:
    starts = [i for i, line in enumerate(lines) if line.startswith("m=")]
    if not starts:
        return "no section"
    k = draw(st.integers(0, len(starts) - 1))
    end = starts[k + 1] if k + 1 < len(starts) else len(lines)
    dropped = lines[starts[k]]
    del lines[starts[k] : end]
    return f"drop section {dropped!r}"


OPS: list[Callable[[st.DrawFn, list[str]], str]] = [
    op_drop,
    op_duplicate,
    op_swap,
    op_shuffle,
    op_garble,
    op_garble,
    op_truncate,
    op_number,
    op_number,
    op_payload_types,
    op_kind,
    op_direction,
    op_fingerprint,
    op_ice,
    op_candidate,
    op_junk,
    op_junk,
    op_huge_line,
    op_drop_section,
]


@dataclass
class MutatedOffer:
    base: str
    steps: list[str]
    sdp: str

    def __repr__(self) -> str:  # the falsifying example says what was done, not 5 KB of SDP
        return f"MutatedOffer({self.base!r}, {self.steps!r}, {len(self.sdp)} characters)"


@st.composite
def mutated_offers(draw: st.DrawFn) -> MutatedOffer:
    base = draw(st.sampled_from(["audio+video", "audio+video", "audio", "video"]))
    lines = BASE_OFFERS[base].split("\r\n")
    steps = []
    for op in draw(st.lists(st.sampled_from(OPS), min_size=0, max_size=4)):
        steps.append(op(draw, lines))
    ending = draw(st.sampled_from(["crlf", "crlf", "lf", "cr", "mixed", "no-final", "spaces"]))
    if ending == "crlf":
        sdp = "\r\n".join(lines)
    elif ending == "lf":
        sdp = "\n".join(lines)
    elif ending == "cr":
        sdp = "\r".join(lines)
    elif ending == "no-final":
        sdp = "\r\n".join(lines).rstrip("\r\n")
    elif ending == "spaces":
        sdp = "\r\n".join(line + " " for line in lines)
    else:
        sdp = lines[0] if lines else ""
        for line in lines[1:]:
            sdp += draw(st.sampled_from(["\r\n", "\n", "\r", "\n\r", "\r\r\n"])) + line
    if ending != "crlf":
        steps.append(f"line endings: {ending}")
    return MutatedOffer(base, steps, sdp)


SDP_OUTCOMES = {(200, None), *OFFER_REFUSALS}


def fuzz_sdp(servers: dict[str, Target], log: ErrorLog, examples: int) -> None:
    seen: Counter[tuple[int, str | None]] = Counter()
    start = time.monotonic()
    target = servers["open"]

    with trials(
        "mutated SDP offers",
        area="input",
        note="real aiortc offers with lines dropped, garbled, shuffled, huge; each answer DELETEd",
    ) as t:

        @fuzz_settings(examples)
        @given(offer=mutated_offers())
        def case(offer: MutatedOffer) -> None:
            with t.trial():
                body = json.dumps({"sdp": offer.sdp, "type": "offer"}).encode()
                reply = send(target.port, "POST", "/offer", body, JSON)
                try:
                    got = outcome(reply)
                    seen[got] += 1
                    if len(body) > MAX_BODY:
                        assert got == (413, "body_too_large"), got
                    elif not offer.sdp.strip():
                        assert got == (400, "bad_offer"), got
                    else:
                        assert got in SDP_OUTCOMES, got
                    if not offer.steps:  # untouched: the contract fixes the answer
                        expected = {"audio+video": (200, None), "audio": (400, "no_video")}
                        assert got == expected.get(offer.base, (400, "no_audio")), got
                finally:
                    if reply.status == 200:
                        tear_down(target, reply, None)
                left_clean(target, log)

        case()
        finish(servers, log)
        t.figures = summary(seen, answered=seen[(200, None)], s=round(time.monotonic() - start, 1))


def test_fuzz_sdp(
    servers: dict[str, Target], base_offers: dict[str, str], error_log: ErrorLog
) -> None:
    fuzz_sdp(servers, error_log, 40)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fuzz_sdp_slow(
    servers: dict[str, Target], base_offers: dict[str, str], error_log: ErrorLog
) -> None:
    fuzz_sdp(servers, error_log, 800)


# -- target: data-channel messages over one real call ------------------------------------------

KINDS = ("say", "text", "interrupt")
other_kinds = json_values.filter(lambda v: not (isinstance(v, str) and v in KINDS))


def _dumps(value: object) -> str:
    return json.dumps(value)  # ASCII: lone surrogates travel as \\ud800 escapes


@st.composite
def nested(draw: st.DrawFn) -> str:
    """A valid-looking message buried in arrays and objects."""
    depth = draw(st.integers(1, 40))
    text: str = _dumps({"type": draw(st.sampled_from(KINDS)), "text": draw(speakable)})
    for _ in range(depth):
        text = draw(st.sampled_from(['{"type": %s}', '{"message": %s}', "[%s]"])) % text
    return text


messages = st.one_of(
    # valid, sometimes with junk fields
    st.builds(
        lambda k, t, junk: _dumps({**junk, "type": k, "text": t}),
        st.sampled_from(["say", "text"]),
        speakable,
        st.dictionaries(odd_text, json_values, max_size=2),
    ),
    st.builds(
        lambda junk: _dumps({**junk, "type": "interrupt"}),
        st.dictionaries(odd_text, json_values, max_size=3),
    ),
    # wrong types and values for "text"
    st.builds(
        lambda k, t: _dumps({"type": k, "text": t}), st.sampled_from(["say", "text"]), refused_text
    ),
    st.sampled_from(["say", "text"]).map(lambda k: _dumps({"type": k})),
    # unknown or missing types
    st.builds(
        lambda k, rest: _dumps({**rest, "type": k}),
        other_kinds,
        st.dictionaries(odd_text, json_values, max_size=2),
    ),
    st.dictionaries(odd_text.filter(lambda k: k != "type"), json_values, max_size=4).map(_dumps),
    # JSON that is not an object, text that is not JSON, binary
    json_values.filter(lambda v: not isinstance(v, dict)).map(_dumps),
    st.text(max_size=80),
    st.binary(max_size=200),
    nested(),
    # huge and odd
    st.sampled_from(
        ["", " ", "{}", "null", '"say"', '{"type": "say", "text": "hi"', "{'type': 'say'}"]
    ),
    st.integers(1, 30_000).map(lambda n: "[" * n),
    st.integers(4300, 60_000).map(lambda n: "1" * n),
    st.integers(1, 60_000).map(lambda n: _dumps("x" * n)),
    st.integers(MAX_CHARS + 1, 30_000).map(lambda n: _dumps({"type": "say", "text": "a" * n})),
    st.integers(1, 60_000).map(lambda n: b"\xff" * n),
)


def expect_event(message: str | bytes) -> str | None:
    """The code of the ``error`` event the message must get, or None when it is valid."""
    if isinstance(message, bytes):
        return "bad_message"
    if len(message) > 12 * MAX_CHARS + 256:  # room for every character as a JSON escape pair
        return "message_too_large"
    try:
        body = json.loads(message)
    except (ValueError, RecursionError):
        return "bad_message"
    if not isinstance(body, dict):
        return "bad_message"
    kind = body.get("type")
    if kind == "interrupt":
        return None
    if isinstance(kind, str) and kind in ("say", "text"):
        refusal = text_refusal(body)
        return refusal[1] if refusal else None
    return "unknown_type"


async def exchange(caller: CallClient, batch: list[str | bytes], codes: list[str]) -> list[str]:
    """Send ``batch``; wait for as many ``error`` events as ``codes`` has; return their codes."""
    mark = len(caller.events)
    for message in batch:
        caller.channel.send(message)
    deadline = time.monotonic() + 20
    while True:
        got = [e["code"] for e in caller.events[mark:] if e.get("type") == "error"]
        if len(got) >= len(codes) or time.monotonic() > deadline:
            # Errors still on their way after these would show up in the next batch.
            await asyncio.sleep(0.02)
            return [e["code"] for e in caller.events[mark:] if e.get("type") == "error"]
        await asyncio.sleep(0.01)


def fuzz_data_channel(
    loop_thread: LoopThread, servers: dict[str, Target], log: ErrorLog, examples: int
) -> None:
    target = servers["open"]
    caller = loop_thread.run(new_caller(target.live.url))
    session_id = loop_thread.run(connect(caller))
    sent: Counter[str] = Counter()
    batches = 0
    start = time.monotonic()

    with trials(
        "fuzzed data-channel messages",
        area="input",
        note="one live call; each message its error event or its effect; the call speaks after",
    ) as t:

        @fuzz_settings(examples)
        @given(batch=st.lists(messages, min_size=1, max_size=6))
        def case(batch: list[str | bytes]) -> None:
            with t.trial():
                nonlocal batches
                codes = [c for c in map(expect_event, batch) if c is not None]
                got = loop_thread.run(exchange(caller, batch, codes))
                assert got == codes, f"error events {got}, expected {codes}"
                for message in batch:
                    sent[expect_event(message) or "valid"] += 1
                batches += 1
                assert caller.pc.connectionState == "connected"
                assert list(target.manager.sessions) == [session_id]
                assert_healthy(target, log)

        try:
            case()
            loop_thread.run(still_speaks(caller))
        finally:
            loop_thread.run(hang_up(caller))
        end_call(target, session_id)
        finish(servers, log)
        t.figures = {
            "batches": batches,
            "valid": sent["valid"],
            "s": round(time.monotonic() - start, 1),
            "errors": ", ".join(f"{k}: {n}" for k, n in sorted(sent.items()) if k != "valid"),
        }


def test_fuzz_data_channel(
    loop_thread: LoopThread, servers: dict[str, Target], error_log: ErrorLog
) -> None:
    fuzz_data_channel(loop_thread, servers, error_log, 40)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fuzz_data_channel_slow(
    loop_thread: LoopThread, servers: dict[str, Target], error_log: ErrorLog
) -> None:
    fuzz_data_channel(loop_thread, servers, error_log, 700)


# -- regressions: what the fuzzing found -------------------------------------------------------
#
# 1. JSON nested a few thousand deep (RecursionError) or with a number over 4,300 digits
#    (ValueError): 500 on every JSON route; on the data channel the exception escaped into
#    aiortc's DTLS receive loop and ended it, so that message silently killed the whole call.
# 2. A token or key with non-ASCII characters, or with bytes that are not UTF-8:
#    hmac.compare_digest raised TypeError / str.encode raised UnicodeEncodeError: 500.
# 3. A say or typed text with a NUL (Piper refuses it) or a lone surrogate ("\ud800" in JSON,
#    no UTF-8 for it): the say failed in a task (logged); a typed text left the call in
#    "thinking" for good, so it never idled out either.
# 4. "Content-Encoding: gzip|deflate" on a body that is not: 500 (RequestPayloadError); and a
#    body claimed deflate that does not end as a deflate stream made the read wait forever
#    (aiohttp never ends that payload), then a ConnectionResetError logged as a 500 when the
#    client gave up. Request bodies may no longer be compressed (415).
# 5. DELETE while the call was already closing (ICE failed on a mangled candidate): 204 at once,
#    with the session still registered until the other close finished.


def test_json_parsing_refuses_what_json_cannot_read() -> None:
    # Nested deeper than Python's recursion limit, numbers too long: all under the size limit.
    for message in ("[" * 5_000, '{"type": ' * 2_500, "1" * 5000, '{"type": 1' + "0" * 5000):
        assert len(message) <= max_message_chars(MAX_CHARS)
        with pytest.raises(SignalingError) as err:
            parse_client_event(message)
        assert (err.value.status, err.value.code) == (400, "bad_message")
    # Longer than any text needs: refused before it is parsed.
    for message in ("[" * 50_000, '{"type": "say", "text": "' + "a" * 30_000 + '"}'):
        with pytest.raises(SignalingError) as err:
            parse_client_event(message)
        assert (err.value.status, err.value.code) == (413, "message_too_large")
    for text in ("a\x00b", "\ud800 hello", "hi \udfff", "bell\x07", "\x1b[2J"):
        with pytest.raises(SignalingError) as err:
            parse_text({"text": text})
        assert (err.value.status, err.value.code) == (400, "bad_text")
    assert parse_text({"text": "héllo 你好 😀"}) == "héllo 你好 😀"


def test_tokens_and_keys_with_any_characters_are_refused_not_crashed() -> None:
    signer = TokenSigner(KEY)
    for token in ("abc.é", "é.é", "\udcff.\udcfe", signer.mint(ttl_s=60) + "é"):
        with pytest.raises(SignalingError) as err:
            signer.verify(token)
        assert (err.value.status, err.value.code) == (401, "bad_token")
    assert not signer.is_api_key("\udcff\udcfe")  # b"\xff\xfe" as aiohttp decodes it
    assert not signer.is_api_key("é" + KEY)
    assert signer.is_api_key(KEY)


ODD_BODIES = [
    b"[" * 30_000 + b"]" * 30_000,
    b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    b'{"sdp": ' + b"9" * 5000 + b', "text": 1, "ttl_s": 1}',
]


@pytest.mark.parametrize("body", ODD_BODIES, ids=["nested-array", "nested-object", "long-int"])
def test_odd_json_is_400_on_every_route(
    servers: dict[str, Target], error_log: ErrorLog, body: bytes
) -> None:
    open_, guarded = servers["open"], servers["guarded"]
    key = [("Authorization", f"Bearer {KEY}".encode())]
    for target, path, headers in (
        (open_, "/offer", JSON),
        (open_, "/sessions/nope/say", JSON),
        (guarded, "/token", key + JSON),
    ):
        reply = send(target.port, "POST", path, body, headers)
        assert (reply.status, assert_error_shape(reply)) == (400, "bad_json"), path
        assert_healthy(target, error_log)


def test_odd_authorization_headers_are_401(servers: dict[str, Target], error_log: ErrorLog) -> None:
    guarded = servers["guarded"]
    for path, value, code in (
        ("/offer", "Bearer abc.é".encode(), "bad_token"),
        ("/offer", b"Bearer abc.\xff", "bad_token"),
        ("/sessions/nope/say", b"Bearer \xff.\xfe", "bad_token"),
        ("/token", b"Bearer \xff\xfe", "unauthorized"),
        ("/token", "Bearer é".encode(), "unauthorized"),
    ):
        reply = send(guarded.port, "POST", path, b"{}", [("Authorization", value)])
        assert (reply.status, assert_error_shape(reply)) == (401, code), (path, value)
    assert_healthy(guarded, error_log)


def _raw_exchange(port: int, head: bytes, body: bytes, *, pause_s: float = 0.2) -> bytes:
    """Headers, a pause (so the body arrives in a read of its own), body; the reply's bytes."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        time.sleep(pause_s)
        sock.sendall(body)
        return sock.recv(65536)


def test_compressed_bodies_are_415_and_never_hang(
    servers: dict[str, Target], error_log: ErrorLog
) -> None:
    open_ = servers["open"]
    offer = json.dumps({"sdp": "v=0\r\n", "type": "offer"}).encode()
    for encoding, body in (
        (b"deflate", b"{}"),  # not deflate: aiohttp never ended this body, the read hung
        (b"gzip", b"{}"),
        (b"gzip", gzip.compress(offer)),
        (b"deflate", zlib.compress(offer)),
    ):
        head = (
            b"POST /offer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Encoding: " + encoding + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        started = time.monotonic()
        reply = _raw_exchange(open_.port, head, body)
        assert reply.startswith(b"HTTP/1.1 415 "), reply[:200]
        assert b'"unsupported_encoding"' in reply
        assert time.monotonic() - started < 5
    assert_healthy(open_, error_log)


def test_a_client_hanging_up_mid_body_is_no_server_error(
    servers: dict[str, Target], error_log: ErrorLog
) -> None:
    import socket

    open_ = servers["open"]
    with socket.create_connection(("127.0.0.1", open_.port), timeout=10) as sock:
        sock.sendall(b'POST /offer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"sdp": ')
        time.sleep(0.2)
    time.sleep(0.3)
    assert_healthy(open_, error_log)


async def test_bad_messages_never_end_the_call(live_server: LiveServer) -> None:
    caller = CallClient(live_server.url, record_video=False)
    handler = ErrorLog()
    logging.getLogger().addHandler(handler)
    try:
        session_id = await connect(caller)
        session = live_server.manager.sessions[session_id]
        bad = [
            "[" * 5_000,
            "1" * 5000,
            '{"type": "say", "text": "\\ud800"}',
            '{"type": "text", "text": "a\\u0000b"}',
            '{"type": "say", "text": "a\\u0000b"}',
        ]
        mark = len(caller.events)
        for message in bad:
            caller.channel.send(message)
        await wait_until(lambda: sum(e["type"] == "error" for e in caller.events[mark:]) >= 5)
        codes = [e["code"] for e in caller.events[mark:] if e["type"] == "error"]
        assert codes == ["bad_message", "bad_message", "bad_text", "bad_text", "bad_text"]
        assert session.state == "listening"  # not stuck in "thinking"
        await still_speaks(caller)
        assert handler.take() == []
    finally:
        logging.getLogger().removeHandler(handler)
        await caller.close()


class FailingTTS:
    """A voice that fails in a way no provider reports (not a ProviderError)."""

    name = "failing"
    sample_rate = 22_050

    async def synthesize(self, text: str, *, previous_text: str = "") -> Any:
        raise RuntimeError("synthesis blew up")
        yield  # an async generator, like every voice


async def test_a_reply_that_fails_unexpectedly_apologizes_and_listens_again(
    live_server: LiveServer,
) -> None:
    import dataclasses

    manager = live_server.manager
    assert manager.providers is not None
    manager.providers = dataclasses.replace(manager.providers, tts=FailingTTS())
    caller = CallClient(live_server.url, record_video=False)
    try:
        session_id = await connect(caller)
        session = manager.sessions[session_id]
        caller.channel.send(json.dumps({"type": "text", "text": "hello there"}))
        error = await caller.wait_event(lambda e: e["type"] == "error")
        assert error["code"] == "internal"
        await caller.wait_state("speaking")  # the apology, in the local voice
        await caller.wait_state("listening", 15)
        assert session.state == "listening"
        caller.channel.send(json.dumps({"type": "say", "text": "and a say"}))
        error = await caller.wait_event(lambda e: e["type"] == "error")
        assert error["code"] == "internal"
    finally:
        await caller.close()


async def test_delete_while_the_call_closes_returns_once_it_is_gone(
    live_server: LiveServer,
) -> None:
    manager = live_server.manager
    async with aiohttp.ClientSession() as http:
        body = {"sdp": await make_offer(), "type": "offer"}
        async with http.post(live_server.url + "/offer", json=body) as resp:
            assert resp.status == 200
            session_id = (await resp.json())["session_id"]
    session = manager.sessions[session_id]
    first = asyncio.ensure_future(session.aclose())  # the connection failed, say
    await asyncio.sleep(0)
    assert session.closed and session_id in manager.sessions  # that close is under way
    assert await manager.close_session(session_id)  # what DELETE does
    assert session_id not in manager.sessions
    await first
