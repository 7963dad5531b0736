"""LLM: any OpenAI-compatible chat completions endpoint, streamed as server-sent events.

The request goes through the app's ``openai.AsyncOpenAI`` (URL, key, timeouts, status errors),
but the body is read here, from the SDK's raw streamed response, not by the SDK's own stream:
compatible servers answer in ways the SDK's stream loses or misreads, and each is kept:

* llama.cpp reports an error on an ``error:`` line, a field the SDK's event decoder drops
  (the stream would just end): :class:`SSEDecoder` passes it on as an event named "error".
* A server that ignores ``"stream": true`` answers one JSON completion, which the SDK's stream
  decodes as no events at all: it is read as one delta.
* vLLM's ``{"object": "error", "code": 400}`` in place of a chunk is not an error to the SDK,
  and an error's HTTP-like code decides whether it is worth a retry.
* A chunk that is not JSON, or lacks its choices or delta, is ``bad_response`` (retryable
  before any text went on), where the SDK raises a bare JSON error or builds a chunk without
  checking it; a stream cut before ``[DONE]`` and without a ``finish_reason`` is one too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rtc_server.providers.base import ChatMessage, ProviderError
from rtc_server.providers.http import DEFAULT_POLICY, HTTPPolicy, bad_response, vendor_detail
from rtc_server.providers.openai_sdk import (
    VENDOR,
    drain,
    media_type,
    request_headers,
    retrier,
    streamed,
)

if TYPE_CHECKING:
    from openai import AsyncOpenAI

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are a friendly assistant speaking through a video avatar. Answer in one to three "
    "short spoken sentences, with no markdown, lists, code or emoji."
)

TokenLimitField = Literal["auto", "max_tokens", "max_completion_tokens"]

_MAX_LINE_BYTES = 1 << 20  # one SSE line; a chunk is ~200 bytes, so this only stops runaways


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    event: str
    """The ``event:`` field; "" when the server sent none (OpenAI never does)."""
    data: str
    """The ``data:`` lines joined with newlines."""


class SSEDecoder:
    """Incremental ``text/event-stream`` parser: bytes in as they arrive, events out.

    Lines may be split anywhere between reads, a UTF-8 character included, so bytes are only
    decoded once a whole line is in. Comments (``: keep-alive``) and unknown fields are skipped,
    as the SSE spec says. llama.cpp reports errors on an ``error:`` line; that is passed on as
    an event named "error".
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._event = ""
        self._data: list[str] = []

    def feed(self, data: bytes) -> Iterator[ServerSentEvent]:
        self._buffer += data
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end]).rstrip(b"\r")
            del self._buffer[: end + 1]
            event = self._line(line.decode("utf-8", errors="replace"))
            if event is not None:
                yield event
        if len(self._buffer) > _MAX_LINE_BYTES:
            raise ValueError(f"an event-stream line is longer than {_MAX_LINE_BYTES} bytes")

    def close(self) -> Iterator[ServerSentEvent]:
        """End of body: a last event not followed by a blank line still counts."""
        if self._buffer:
            event = self._line(bytes(self._buffer).decode("utf-8", errors="replace"))
            self._buffer.clear()
            if event is not None:
                yield event
        event = self._line("")
        if event is not None:
            yield event

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            if not self._data and not self._event:
                return None
            event = ServerSentEvent(self._event, "\n".join(self._data))
            self._event, self._data = "", []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "error":
            self._event = "error"
            self._data.append(value)
        return None


class OpenAILLM:
    """Streams a reply from ``POST {base_url}/chat/completions`` with ``stream: true``.

    Works with OpenAI and with OpenAI-compatible servers (vLLM, Ollama, llama.cpp): see the
    module docstring. The reply cap is sent as ``max_completion_tokens`` to api.openai.com,
    whose newer models reject ``max_tokens``, and as ``max_tokens`` elsewhere, the one field
    every compatible server reads (Ollama and older llama.cpp ignore the new name);
    ``token_limit_field`` overrides that.

    Args:
        client: the app's SDK client (``openai_sdk.openai_client``), pointed at the endpoint's
            base URL, up to and including ``/v1``; never closed here.
        model: the model name the endpoint knows.
        system_prompt: prepended as a system message unless the conversation starts with one;
            "" sends none.
        max_tokens: cap on the reply length, so a talkative model cannot monologue.
        temperature: sent only when given; reasoning models reject anything but the default.
        policy: retries and the limit on one attempt; the client has the other timeouts.
    """

    def __init__(
        self,
        client: AsyncOpenAI,
        *,
        model: str = "gpt-4o-mini",
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        max_tokens: int = 200,
        token_limit_field: TokenLimitField = "auto",
        temperature: float | None = None,
        policy: HTTPPolicy = DEFAULT_POLICY,
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        host = client.base_url.host
        official = host == "api.openai.com"
        if token_limit_field == "auto":
            token_limit_field = "max_completion_tokens" if official else "max_tokens"
        self.model = model
        self.system_prompt = system_prompt
        self.max_tokens = max_tokens
        self.token_limit_field: str = token_limit_field
        self.temperature = temperature
        self._client = client
        self._headers = request_headers(client, {"Accept": "text/event-stream"})
        self._policy = policy
        self._provider = "openai-llm"
        self._vendor = VENDOR if official else f"the chat endpoint at {host}"
        self._retrier = retrier(client, provider=self._provider, policy=policy, vendor=self._vendor)

    @property
    def name(self) -> str:
        return "openai"

    def stream(self, messages: Sequence[ChatMessage]) -> AsyncGenerator[str, None]:
        body = self._body(messages)
        return self._retrier.stream(lambda: self._attempt(body))

    def _body(self, messages: Sequence[ChatMessage]) -> dict[str, Any]:
        wire = [{"role": m.role, "content": m.content} for m in messages]
        if self.system_prompt and not (messages and messages[0].role == "system"):
            wire.insert(0, {"role": "system", "content": self.system_prompt})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": wire,
            "stream": True,
            self.token_limit_field: self.max_tokens,
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    async def _attempt(self, body: dict[str, Any]) -> AsyncGenerator[str, None]:
        """One request: the reply's text deltas as they arrive, or a ProviderError."""
        create = self._client.chat.completions.with_streaming_response.create
        request = create(**body, extra_headers=self._headers)
        async with streamed(
            request, provider=self._provider, policy=self._policy, vendor=self._vendor
        ) as (response, chunks):
            if media_type(response.headers) == "application/json":
                # A compatible server that ignores "stream": one JSON completion (or error).
                text = self._message(self._parse(b"".join([c async for c in chunks])))
                if text:
                    yield text
                return
            async with aclosing(self._read(chunks)) as deltas:
                async for delta in deltas:
                    yield delta

    async def _read(self, chunks: AsyncIterator[bytes]) -> AsyncGenerator[str, None]:
        """The deltas of an event stream; what follows ``[DONE]`` is drained, to keep the
        connection."""
        decoder = SSEDecoder()
        finished = False
        try:
            async for data in chunks:
                for event in decoder.feed(data):
                    if event.data == "[DONE]":
                        await drain(chunks)
                        return
                    delta, done = self._delta(event)
                    finished = finished or done
                    if delta:
                        yield delta
            for event in decoder.close():
                if event.data == "[DONE]":
                    return
                delta, done = self._delta(event)
                finished = finished or done
                if delta:
                    yield delta
        except ValueError as exc:
            raise self._malformed(str(exc)) from exc
        if not finished:
            raise self._malformed("the event stream ended before [DONE]")
        logger.debug("%s: stream ended without [DONE] after finish_reason", self._provider)

    def _delta(self, event: ServerSentEvent) -> tuple[str, bool]:
        """(text, finished) of one ``chat.completion.chunk``."""
        chunk = self._parse(event.data.encode())
        if event.event == "error" or "error" in chunk or chunk.get("object") == "error":
            raise self._stream_error(chunk)
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise self._malformed("a chunk without choices")
        if not choices:
            return "", False  # the usage chunk at the end of a stream
        choice = choices[0]
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            raise self._malformed("a chunk without a delta")
        content = delta.get("content")
        if content is not None and not isinstance(content, str):
            raise self._malformed("a delta whose content is not text")
        return content or "", choice.get("finish_reason") is not None

    def _message(self, completion: dict[str, Any]) -> str:
        if "error" in completion or completion.get("object") == "error":
            raise self._stream_error(completion)
        try:
            content = completion["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            raise self._malformed("a completion without choices[0].message") from exc
        if content is not None and not isinstance(content, str):
            raise self._malformed("a message whose content is not text")
        return content or ""

    def _parse(self, data: bytes) -> dict[str, Any]:
        try:
            parsed = json.loads(data)
        except ValueError as exc:
            raise self._malformed(f"invalid JSON {data[:80]!r}") from exc
        if not isinstance(parsed, dict):
            raise self._malformed(f"expected a JSON object, got {data[:80]!r}")
        return parsed

    def _stream_error(self, body: dict[str, Any]) -> ProviderError:
        """An error the server reported inside a 200 response, usually mid-generation."""
        detail, code = vendor_detail(json.dumps(body).encode())
        error = body.get("error")
        status = error.get("code") if isinstance(error, dict) else body.get("code")
        status = status if isinstance(status, int) else None
        final = (status is not None and 400 <= status < 500 and status not in (408, 429)) or (
            code in ("invalid_request_error", "authentication_error", "context_length_exceeded")
        )
        return ProviderError(
            self._provider,
            f"{self._vendor} reported an error in the stream: {detail}",
            retryable=not final,
            status=status,
            code="vendor_error",
        )

    def _malformed(self, what: str) -> ProviderError:
        return bad_response(self._provider, self._vendor, what)
