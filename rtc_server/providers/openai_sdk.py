"""The app's one client of the official ``openai`` SDK, and its errors in our terms.

Every OpenAI provider (LLM, STT, TTS, Realtime) talks through the :class:`openai.AsyncOpenAI`
made here, once per app: the policy's timeouts, the SDK's own retries off (our rule is kept by
the providers, each through a :func:`retrier`: retry only before any output went on), no
redirects followed, and any OpenAI-compatible base URL (vLLM, Ollama, llama.cpp), its
WebSocket URL derived from it.

The SDK has no limit on one attempt end to end: :func:`streamed` applies the policy's
``total_timeout_s`` to a streamed body. :func:`sdk_errors` turns what the SDK and its HTTP
library raise into :class:`ProviderError`, the way ``http.status_error`` reads a status.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from rtc_server.providers.base import ProviderError
from rtc_server.providers.http import (
    DEFAULT_POLICY,
    HTTPPolicy,
    Retrier,
    status_error,
    transport_error,
)

if TYPE_CHECKING:
    from openai import AsyncAPIResponse, AsyncOpenAI, Omit

Response = TypeVar("Response", bound="AsyncAPIResponse[Any]")

VENDOR = "OpenAI"
OPENAI_BASE_URL = "https://api.openai.com/v1"
NO_KEY = "no-key"
"""The key a client gets when none is configured (local servers): the SDK insists on one."""
_DRAIN_LIMIT = 65_536  # bytes read after the end of a stream to keep its connection


def openai_client(
    api_key: str | None,
    base_url: str = OPENAI_BASE_URL,
    policy: HTTPPolicy = DEFAULT_POLICY,
    *,
    uds: str | None = None,
) -> AsyncOpenAI:
    """An SDK client for ``base_url`` (up to ``/v1``) with the policy's timeouts; ``uds``: the
    requests go to this unix socket (the local model process), ``base_url`` only names them.

    A local server without keys still gets a placeholder (:data:`NO_KEY`): the SDK refuses to
    start without one; :func:`request_headers` keeps it off the wire. Redirects are not
    followed: a vendor endpoint that moves is an error.
    """
    import httpx2
    from openai import AsyncOpenAI, DefaultAsyncHttpx2Client

    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"base URL must be http(s): {base_url!r}")
    timeout = httpx2.Timeout(
        policy.total_timeout_s,
        connect=policy.connect_timeout_s,
        read=policy.read_timeout_s,
        pool=policy.connect_timeout_s,
    )
    return AsyncOpenAI(
        api_key=api_key or NO_KEY,
        base_url=base_url,
        timeout=timeout,
        max_retries=0,
        http_client=DefaultAsyncHttpx2Client(
            timeout=timeout,
            follow_redirects=False,
            **({} if uds is None else {"transport": httpx2.AsyncHTTPTransport(uds=uds)}),
        ),
    )


def retrier(
    client: AsyncOpenAI, *, provider: str, policy: HTTPPolicy, vendor: str = VENDOR
) -> Retrier:
    """Our retry rule for a provider on ``client``, its API key blanked out of error text."""
    key = client.api_key
    return Retrier(
        provider=provider, vendor=vendor, policy=policy, secret="" if key == NO_KEY else key
    )


def request_headers(
    client: AsyncOpenAI, headers: Mapping[str, str] | None = None
) -> dict[str, str | Omit]:
    """``extra_headers`` for a provider's requests: ``headers``, and no ``Authorization`` at
    all when the client has no key, rather than the placeholder as a bearer token."""
    from openai import omit

    extra: dict[str, str | Omit] = dict(headers or {})
    if client.api_key == NO_KEY:
        extra["Authorization"] = omit
    return extra


def sdk_error(provider: str, exc: BaseException, vendor: str = VENDOR) -> ProviderError:
    """An SDK or transport exception as a :class:`ProviderError`: statuses as the HTTP
    providers read them; timeouts and broken connections retryable."""
    import httpx2
    import openai

    if isinstance(exc, openai.APIStatusError):
        response = exc.response
        body = response.content if response is not None else b""
        if not body and exc.body is not None:
            body = json.dumps(exc.body).encode()
        return status_error(provider, vendor, exc.status_code, body, response.headers)
    if isinstance(exc, openai.APITimeoutError | httpx2.TimeoutException | TimeoutError):
        return transport_error(provider, vendor, TimeoutError(str(exc)))
    if isinstance(exc, openai.APIConnectionError):
        return ProviderError(
            provider,
            f"cannot reach {vendor}: {exc.__cause__ or exc}",
            retryable=True,
            code="connection",
        )
    if isinstance(exc, httpx2.RequestError):
        # Raised while a body is read: the connection broke or the bytes did not decode.
        return ProviderError(
            provider, f"{vendor} broke off the response: {exc}", retryable=True, code="connection"
        )
    return ProviderError(provider, f"request to {vendor} failed: {exc}", retryable=False)


@contextmanager
def sdk_errors(provider: str, vendor: str = VENDOR) -> Iterator[None]:
    """Raise what the SDK, its HTTP library or a timeout raise in the block as
    :func:`sdk_error` makes of it; our own ProviderErrors pass unchanged."""
    import httpx2
    import openai

    try:
        yield
    except (openai.OpenAIError, httpx2.RequestError, TimeoutError) as exc:
        # A status error's text holds the server's words (a key echoed back, maybe), already
        # read into ours, where the key is blanked out: it is not chained.
        cause = None if isinstance(exc, openai.APIStatusError) else exc
        raise sdk_error(provider, exc, vendor) from cause


@asynccontextmanager
async def streamed(
    request: AbstractAsyncContextManager[Response],
    *,
    provider: str,
    policy: HTTPPolicy,
    vendor: str = VENDOR,
) -> AsyncIterator[tuple[Response, AsyncIterator[bytes]]]:
    """Send a ``with_streaming_response`` request: its response, and the body's bytes as they
    arrive until the policy's ``total_timeout_s`` from now (sending is bounded by the client's
    connect and read timeouts). Failures in the block, while sending or reading, are raised as
    :func:`sdk_errors` makes them; on leaving it the response is closed, and with it the
    connection unless the body was read to the end."""
    ends = asyncio.get_running_loop().time() + policy.total_timeout_s
    with sdk_errors(provider, vendor):
        async with request as response, aclosing(_within(response.iter_bytes(), ends)) as body:
            yield response, body


async def _within(chunks: AsyncIterator[bytes], deadline: float) -> AsyncGenerator[bytes, None]:
    """``chunks`` as they come, until the event loop's clock reaches ``deadline``: then
    TimeoutError. Only a wait for a chunk is ever interrupted, never the caller's own work."""
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        yield chunk


async def drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows the end of a stream (e.g. after ``[DONE]``) so the connection can go
    back to the pool; past a limit, or when the connection fails, it is simply closed later."""
    import httpx2

    drained = 0
    try:
        async for data in chunks:
            drained += len(data)
            if drained > _DRAIN_LIMIT:
                return
    except (httpx2.RequestError, TimeoutError):
        pass  # the answer was complete; only the connection is lost


def media_type(headers: Mapping[str, str]) -> str:
    """The ``Content-Type`` without its parameters, lower case; "" when there is none."""
    return headers.get("content-type", "").partition(";")[0].strip().lower()
