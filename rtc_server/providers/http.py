"""What the cloud providers share: timeouts and retries, error translation.

Every cloud provider keeps one rule for retries, :class:`Retrier`: bounded retries with
backoff, for retryable errors only and only before any output was handed on (spoken audio and
text deltas cannot be taken back), ``Retry-After`` honoured up to a cap, and the API key
blanked out of whatever a server echoes back. Vendor and transport failures become
:class:`ProviderError` here (:func:`status_error`, :func:`transport_error`,
:func:`bad_response`), and the OpenAI SDK's errors are read the same way
(``openai_sdk.sdk_error``).

ElevenLabs is spoken to over the app's one ``aiohttp.ClientSession`` by a
:class:`VendorClient`: the policy's per-request timeouts and the retry rule around each POST.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from rtc_server.providers.base import ProviderError

logger = logging.getLogger(__name__)

T = TypeVar("T")

ELEVENLABS_BASE_URL = "https://api.elevenlabs.io"

_MAX_ERROR_DETAIL = 300  # characters of a vendor's error message kept in ours


@dataclass(frozen=True, slots=True, kw_only=True)
class HTTPPolicy:
    """Timeouts and retries for one provider's requests.

    The defaults suit a live conversation: fail over to the apology quickly rather than leave
    the user waiting. Tests pass tiny values.
    """

    connect_timeout_s: float = 5.0
    """Getting a connection (pool wait, DNS, TCP and TLS handshakes)."""
    read_timeout_s: float = 15.0
    """Longest silence between two reads, including the wait for the first byte."""
    total_timeout_s: float = 60.0
    """One attempt end to end, streaming the whole body included."""
    max_attempts: int = 3
    """Attempts in all, the first included; 1 turns retries off."""
    backoff_initial_s: float = 0.25
    """Wait before the first retry; it doubles per retry up to ``backoff_max_s``."""
    backoff_max_s: float = 2.0
    jitter: float = 0.2
    """Random extra wait, as a fraction of the backoff, so sessions don't retry in lockstep."""
    max_retry_after_s: float = 5.0
    """Cap on a server's ``Retry-After``; a conversation cannot wait longer than this."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "read_timeout_s", "total_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not 0 <= self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 <= backoff_initial_s <= backoff_max_s")
        if self.jitter < 0 or self.max_retry_after_s < 0:
            raise ValueError("jitter and max_retry_after_s must be >= 0")

    def client_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=self.total_timeout_s,
            connect=self.connect_timeout_s,
            sock_connect=self.connect_timeout_s,
            sock_read=self.read_timeout_s,
        )

    def retry_delay_s(self, retry: int, retry_after_s: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based)."""
        if retry_after_s is not None:
            return min(max(retry_after_s, 0.0), self.max_retry_after_s)
        backoff = min(self.backoff_initial_s * 2.0 ** (retry - 1), self.backoff_max_s)
        return backoff * (1 + random.uniform(0, self.jitter))


DEFAULT_POLICY = HTTPPolicy()


class HTTPStatusError(ProviderError):
    """A vendor answered with a non-2xx status; ``retry_after_s`` is its hint, if it sent one."""

    def __init__(
        self,
        provider: str,
        message: str,
        *,
        retryable: bool,
        status: int,
        code: str,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(provider, message, retryable=retryable, status=status, code=code)
        self.retry_after_s = retry_after_s


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds from ``retry-after-ms`` (OpenAI) or ``Retry-After`` (seconds or an HTTP date)."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(float(millis) / 1000, 0.0)
        except ValueError:
            pass
    value = headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


def vendor_detail(body: bytes) -> tuple[str, str | None]:
    """(message, machine code) from an error body in OpenAI's, ElevenLabs' or FastAPI's shape."""
    try:
        text = body.decode("utf-8").strip()
    except UnicodeDecodeError:
        # e.g. audio sent with an error status: no use in a message shown to people.
        return f"{len(body)} bytes of non-text data", None
    if any(c < " " and c not in "\t\r\n" for c in text):
        return f"{len(body)} bytes of non-text data", None
    try:
        data = json.loads(text)
    except ValueError:
        return text[:_MAX_ERROR_DETAIL], None
    message: Any = None
    code: Any = None
    if isinstance(data, dict):
        # OpenAI: {"error": {"message", "type", "code"}}; ElevenLabs: {"detail": {"status",
        # "message"}}; validation errors: {"detail": [{"msg"}]}; vLLM: {"object": "error", ...}.
        inner = data.get("error", data.get("detail", data))
        if isinstance(inner, list) and inner and isinstance(inner[0], dict):
            inner = inner[0]
        if isinstance(inner, dict):
            message = inner.get("message", inner.get("msg"))
            code = inner.get("code") or inner.get("status") or inner.get("type")
        elif isinstance(inner, str):
            message = inner
    if not isinstance(message, str) or not message:
        message = text
    return message[:_MAX_ERROR_DETAIL], code if isinstance(code, str) else None


def status_error(
    provider: str, vendor: str, status: int, body: bytes, headers: Mapping[str, str]
) -> HTTPStatusError:
    """Translate a non-2xx answer: 4xx are final except 408 and 429; 5xx are retryable."""
    detail, vendor_code = vendor_detail(body)
    retryable = status in (408, 429) or status >= 500
    if vendor_code in ("insufficient_quota", "quota_exceeded"):
        # OpenAI says "out of credits" with a 429 and ElevenLabs with a 401: waiting won't help.
        return HTTPStatusError(
            provider,
            f"{vendor} quota is used up ({status}): {detail}",
            retryable=False,
            status=status,
            code="quota_exceeded",
        )
    if status == 401:
        message, code = f"{vendor} rejected the API key (401): {detail}", "unauthorized"
    elif status == 403:
        message, code = f"{vendor} refused access with this API key (403): {detail}", "unauthorized"
    elif status == 408:
        message, code = f"{vendor} timed out waiting for the request (408): {detail}", "timeout"
    elif status == 429:
        message, code = f"{vendor} is rate limiting us (429): {detail}", "rate_limited"
    elif status >= 500:
        message, code = f"{vendor} server error ({status}): {detail}", "server_error"
    else:
        message, code = f"{vendor} rejected the request ({status}): {detail}", "bad_request"
    return HTTPStatusError(
        provider,
        message,
        retryable=retryable,
        status=status,
        code=code,
        retry_after_s=parse_retry_after(headers) if retryable else None,
    )


def transport_error(provider: str, vendor: str, exc: BaseException) -> ProviderError:
    """Translate an aiohttp/asyncio failure; connection trouble and timeouts are retryable."""
    if isinstance(exc, TimeoutError):
        return ProviderError(
            provider, f"{vendor} did not answer in time", retryable=True, code="timeout"
        )
    if isinstance(exc, aiohttp.ClientPayloadError):
        return ProviderError(
            provider, f"{vendor} broke off the response: {exc}", retryable=True, code="connection"
        )
    if isinstance(exc, aiohttp.ClientConnectionError):
        return ProviderError(
            provider, f"cannot reach {vendor}: {exc}", retryable=True, code="connection"
        )
    return ProviderError(provider, f"request to {vendor} failed: {exc}", retryable=False)


def bad_response(provider: str, vendor: str, what: str) -> ProviderError:
    """A 2xx answer we cannot use; as likely a proxy hiccup as a bug, so worth one more try."""
    return ProviderError(
        provider, f"{vendor} sent a malformed response: {what}", retryable=True, code="bad_response"
    )


ReadStream = Callable[[aiohttp.ClientResponse], AsyncGenerator[T, None]]


class Retrier:
    """Our retry rule for one provider, around attempts that raise :class:`ProviderError`.

    An attempt is one request; it translates its own library's failures into ProviderErrors
    (:func:`status_error`, :func:`transport_error`, ``openai_sdk.sdk_error``). Retryable ones
    are tried again with the policy's backoff, or after the server's ``Retry-After`` up to the
    policy's cap, until ``max_attempts``; final ones, and the last, are raised with the key
    blanked out.

    Args:
        provider: ``ProviderError.provider`` and the log prefix, e.g. ``"openai-llm"``.
        vendor: how messages name the vendor, e.g. ``"OpenAI"``.
        policy: attempts, backoff and the ``Retry-After`` cap.
        secret: the API key, blanked out of any error text a server echoes back.
    """

    def __init__(self, *, provider: str, vendor: str, policy: HTTPPolicy, secret: str = "") -> None:
        self.provider = provider
        self.vendor = vendor
        self.policy = policy
        self._secret = secret

    async def stream(
        self, attempt: Callable[[], AsyncGenerator[T, None]]
    ) -> AsyncGenerator[T, None]:
        """Yield the items of ``attempt()``, a fresh one per try, as they arrive.

        Retries happen only until the first item was yielded; a failure after that is raised
        with ``retryable=False``, since the caller has already used part of the answer. When the
        caller stops early, the attempt is closed at once (and with it the response), so the
        vendor stops generating.
        """
        retry = 0
        while True:
            yielded = False
            try:
                async with aclosing(attempt()) as items:
                    async for item in items:
                        yielded = True
                        yield item
                return
            except ProviderError as exc:
                if yielded:
                    raise self._clean(exc, after_output=True) from exc
                retry += 1
                delay = self._retry_delay(exc, retry)
                if delay is None:
                    raise self._clean(exc) from exc.__cause__
            await asyncio.sleep(delay)

    async def call(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """The result of ``attempt()``, a fresh one per try, retrying per the policy."""
        retry = 0
        while True:
            try:
                return await attempt()
            except ProviderError as exc:
                retry += 1
                delay = self._retry_delay(exc, retry)
                if delay is None:
                    raise self._clean(exc) from exc.__cause__
            await asyncio.sleep(delay)

    def _retry_delay(self, exc: ProviderError, retry: int) -> float | None:
        """Seconds before the next attempt, or None when this error is final."""
        if not exc.retryable or retry >= self.policy.max_attempts:
            return None
        retry_after = exc.retry_after_s if isinstance(exc, HTTPStatusError) else None
        delay = self.policy.retry_delay_s(retry, retry_after)
        logger.warning(
            "%s: %s; retry %d of %d in %.2f s",
            self.provider,
            self._redact(exc.message),
            retry,
            self.policy.max_attempts - 1,
            delay,
        )
        return delay

    def _clean(self, exc: ProviderError, *, after_output: bool = False) -> ProviderError:
        """``exc`` with the key blanked out, made final if output was already handed on."""
        message = self._redact(exc.message)
        if after_output:
            message += " (after part of the answer was delivered)"
        elif message == exc.message:
            return exc
        return ProviderError(
            exc.provider,
            message,
            retryable=exc.retryable and not after_output,
            status=exc.status,
            code=exc.code,
        )

    def _redact(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text


class VendorClient:
    """POSTs to one vendor through a shared aiohttp session, with the policy's timeouts and
    the :class:`Retrier`'s rule.

    Args:
        session: the app's connection pool; never closed here.
        provider: ``ProviderError.provider`` and the log prefix, e.g. ``"elevenlabs-tts"``.
        vendor: how messages name the vendor, e.g. ``"ElevenLabs"``.
        base_url: prefix of every path; the tests point it at 127.0.0.1.
        headers: sent with every request; holds the API key, so it is never logged.
        secret: the API key, blanked out of any error text a server echoes back.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        provider: str,
        vendor: str,
        base_url: str,
        headers: Mapping[str, str],
        policy: HTTPPolicy,
        secret: str = "",
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must be http(s): {base_url!r}")
        self._session = session
        self.provider = provider
        self.vendor = vendor
        self.base_url = base_url.rstrip("/")
        self._headers = dict(headers)
        self.policy = policy
        self._retrier = Retrier(provider=provider, vendor=vendor, policy=policy, secret=secret)
        self._timeout = policy.client_timeout()

    def stream(
        self,
        path: str,
        read: ReadStream[T],
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[T, None]:
        """POST and yield what ``read`` makes of the response, as it arrives (see
        :meth:`Retrier.stream`: retried only before the first item)."""
        return self._retrier.stream(lambda: self._stream_once(path, read, json_body, params))

    async def _stream_once(
        self, path: str, read: ReadStream[T], json_body: Any, params: Mapping[str, str] | None
    ) -> AsyncGenerator[T, None]:
        try:
            async with self._session.post(
                self.base_url + path,
                json=json_body,
                params=params,
                headers=self._headers,
                timeout=self._timeout,
                allow_redirects=False,
            ) as response:
                await self._raise_for_status(response)
                finished = False
                try:
                    async with aclosing(read(response)) as items:
                        async for item in items:
                            yield item
                    finished = await _drain(response)
                finally:
                    if not finished:
                        response.close()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise transport_error(self.provider, self.vendor, exc) from exc

    async def _raise_for_status(self, response: aiohttp.ClientResponse) -> None:
        if 200 <= response.status < 300:
            return
        body = await response.read()
        raise status_error(self.provider, self.vendor, response.status, body, response.headers)


async def _drain(response: aiohttp.ClientResponse, limit: int = 65_536) -> bool:
    """Read what follows the end of a stream so the connection can go back to the pool;
    False when it cannot be, and the response should be closed instead."""
    drained = 0
    try:
        while drained <= limit and not response.content.at_eof():
            drained += len(await response.content.readany())
    except (aiohttp.ClientError, TimeoutError):
        return False  # the answer was complete; only the connection is lost
    return response.content.at_eof()
