"""LLM: any OpenAI-compatible chat completions endpoint, streamed as server-sent events."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

from rtc_server.providers.base import ChatMessage, ProviderError
from rtc_server.providers.http import (
    DEFAULT_POLICY,
    OPENAI_BASE_URL,
    HTTPPolicy,
    VendorClient,
    bad_response,
    vendor_detail,
)

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

    Works with OpenAI and with OpenAI-compatible servers (vLLM, Ollama, llama.cpp). The reply
    cap is sent as ``max_completion_tokens`` to api.openai.com, whose newer models reject
    ``max_tokens``, and as ``max_tokens`` elsewhere, the one field every compatible server reads
    (Ollama and older llama.cpp ignore the new name); ``token_limit_field`` overrides that.

    Args:
        session: the app's shared connection pool.
        api_key: sent as ``Authorization: Bearer``; "" sends none (local servers).
        base_url: up to and including ``/v1``.
        model: the model name the endpoint knows.
        system_prompt: prepended as a system message unless the conversation starts with one;
            "" sends none.
        max_tokens: cap on the reply length, so a talkative model cannot monologue.
        temperature: sent only when given; reasoning models reject anything but the default.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        api_key: str,
        base_url: str = OPENAI_BASE_URL,
        model: str = "gpt-4o-mini",
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        max_tokens: int = 200,
        token_limit_field: TokenLimitField = "auto",
        temperature: float | None = None,
        policy: HTTPPolicy = DEFAULT_POLICY,
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        host = urlsplit(base_url).hostname or ""
        official = host == "api.openai.com"
        if token_limit_field == "auto":
            token_limit_field = "max_completion_tokens" if official else "max_tokens"
        self.model = model
        self.system_prompt = system_prompt
        self.max_tokens = max_tokens
        self.token_limit_field: str = token_limit_field
        self.temperature = temperature
        headers = {"Accept": "text/event-stream"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._client = VendorClient(
            session,
            provider="openai-llm",
            vendor="OpenAI" if official else f"the chat endpoint at {host}",
            base_url=base_url,
            headers=headers,
            policy=policy,
            secret=api_key,
        )

    @property
    def name(self) -> str:
        return "openai"

    def stream(self, messages: Sequence[ChatMessage]) -> AsyncGenerator[str, None]:
        return self._client.stream("/chat/completions", self._read, json_body=self._body(messages))

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

    async def _read(self, response: aiohttp.ClientResponse) -> AsyncGenerator[str, None]:
        if response.content_type == "application/json":
            # A compatible server that ignores "stream": one JSON completion (or error) instead.
            text = self._message(self._parse(await response.read()))
            if text:
                yield text
            return
        decoder = SSEDecoder()
        finished = False
        try:
            async for data in response.content.iter_any():
                for event in decoder.feed(data):
                    if event.data == "[DONE]":
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
        logger.debug("%s: stream ended without [DONE] after finish_reason", self._client.provider)

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
            self._client.provider,
            f"{self._client.vendor} reported an error in the stream: {detail}",
            retryable=not final,
            status=status,
            code="vendor_error",
        )

    def _malformed(self, what: str) -> ProviderError:
        return bad_response(self._client.provider, self._client.vendor, what)
