"""One streamed request of `pdserve bench`, timed as vLLM's `bench serve` times it: TTFT is the first
SSE data event with a choice, every later such event adds one inter-token latency (ITL), and the
latency is the last such event's time; the output token count is the final usage chunk's
`completion_tokens` (the request asks for `stream_options.include_usage`).

A request fails (`success` False, `error` says why) on a non-200 answer, an error event, a stream that
ends without `[DONE]`, a dropped connection, or no byte for `timeout` seconds; it never raises.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass(slots=True)
class RequestOutput:
    prompt_len: int
    success: bool = False
    start_time: float = 0.0  # perf_counter when it was sent
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between consecutive events after the first
    latency: float = 0.0  # seconds from sending to the last event
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""


def request_body(endpoint: str, model: str, prompt: str | list[int], max_tokens: int, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's and pdserve's extension: exactly max_tokens tokens
    if endpoint.endswith("/chat/completions"):
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint needs text prompts (token-id prompts work on /v1/completions)")
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = prompt
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int, headers: dict[str, str]
               ) -> RequestOutput:
    """POST `body` to `url` and read its SSE stream to the end."""
    out = RequestOutput(prompt_len)
    out.start_time = last = time.perf_counter()
    text: list[str] = []
    done = False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                out.error = f"HTTP {response.status_code}: {detail}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return out
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if not out.ttft:
                        out.ttft = now - out.start_time
                    else:
                        out.itl.append(now - last)
                    last = now
                    choice = chunk["choices"][0]
                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                if chunk.get("usage"):
                    out.output_tokens = chunk["usage"].get("completion_tokens", 0)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        out.error = f"{type(error).__name__}: {error}"
        return out
    except (KeyError, IndexError, TypeError, AttributeError) as error:  # an event not shaped as OpenAI's
        out.error = f"malformed event ({type(error).__name__}: {error})"
        return out
    if not done:
        out.error = "the stream ended without [DONE]"
        return out
    out.latency = last - out.start_time
    out.generated_text = "".join(text)
    out.success = out.ttft > 0
    if not out.success:
        out.error = "no token came back"
    return out
