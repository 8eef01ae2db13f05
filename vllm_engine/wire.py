"""The HTTP wire format between a vLLM worker and its vLLM OpenAI server: the /v1/completions body we send
(token ids in, token ids out, no text-level stops), and the parsing and validation of everything the server sends
back (a completion or its streamed chunks, logprobs, usage, an error, the gauges of its /metrics page). A field
that does not parse raises `VllmProtocolError`; nothing the server sends is used unchecked."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.sampling import Logprob, SamplingParams

MAX_CHUNK = 1 << 20  # bytes of one streamed chunk (or one completion)
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class VllmProtocolError(ValueError):
    """What the vLLM server sent does not parse as the API we use."""


@dataclass
class ServerLoad:
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int = 0


def parse_load(text: str) -> ServerLoad:
    """vLLM's gauges summed over its engines (data-parallel ranks)."""
    load = ServerLoad()
    usage: list[float] = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:num_requests_waiting":
                load.num_waiting += int(s.value)
            elif s.name == "vllm:num_requests_running":
                load.num_running += int(s.value)
            elif s.name == "vllm:kv_cache_usage_perc":
                usage.append(float(s.value))
            elif s.name == "vllm:cache_config_info":
                blocks = s.labels.get("num_gpu_blocks", "")
                if blocks.isdigit():
                    load.num_kv_blocks += int(blocks)
    load.kv_usage = sum(usage) / len(usage) if usage else 0.0
    return load


def resumed_seed(seed: int, offset: int) -> int:
    """vLLM's seed for a request resumed at output position `offset` (vLLM's generator cannot skip ahead)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{offset}".encode(), digest_size=8).digest(), "big") >> 1


def request_body(model: str, request_id: str, prompt: Sequence[int], p: SamplingParams, priority: int,
                 stream: bool) -> dict[str, Any]:
    """A /v1/completions body: token ids in, token ids out, no text-level stops (the gateway applies those).

    A moved request (output_offset > 0: its prompt already ends with the output it produced elsewhere) continues
    greedily exactly; a seeded sampled one draws from vLLM's own generator, seeded from (seed, output_offset), so
    its continuation is repeatable but not the one an undisturbed run would have sampled."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(prompt), "max_tokens": p.max_tokens, "temperature": p.temperature,
        "top_p": p.top_p, "top_k": p.top_k or -1, "min_tokens": p.min_tokens, "ignore_eos": p.ignore_eos,
        "stop_token_ids": list(p.stop_token_ids), "return_token_ids": True, "request_id": request_id,
        "skip_special_tokens": False, "stream": stream}
    if p.seed is not None:
        body["seed"] = p.seed if not p.output_offset else resumed_seed(p.seed, p.output_offset)
    if priority:
        body["priority"] = priority
    if p.logprobs is not None:
        body["logprobs"] = p.logprobs
        body["return_tokens_as_token_ids"] = True
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def _token_id(text: Any) -> int:
    if not isinstance(text, str) or not text.startswith("token_id:") or not text[9:].isdigit():
        raise VllmProtocolError(f"logprobs token {str(text)[:40]!r} is not token_id:N")
    return int(text[9:])


def parse_logprobs(lp: Any, n: int, want: int | None) -> list[Logprob]:
    if want is None:
        return []
    if not isinstance(lp, dict):
        raise VllmProtocolError("choices[0].logprobs: not an object")
    tokens, values, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    if not (isinstance(tokens, list) and isinstance(values, list) and len(tokens) == len(values) == n):
        raise VllmProtocolError("choices[0].logprobs: tokens and token_logprobs do not match token_ids")
    out = []
    for i in range(n):
        top: list[tuple[int, float]] = []
        if want and isinstance(tops, list) and i < len(tops) and isinstance(tops[i], dict):
            top = sorted(((_token_id(k), float(v)) for k, v in tops[i].items()), key=lambda t: -t[1])[:want]
        value = values[i]
        out.append(Logprob(_token_id(tokens[i]), float(value) if isinstance(value, int | float) else float("-inf"),
                           top))
    return out


def parse_choice(chunk: Any, vocab_size: int) -> tuple[list[int], Any, str | None, Any]:
    """(token ids, logprobs, finish_reason, stop_reason) of a completion (chunk) with one choice."""
    if not isinstance(chunk, dict):
        raise VllmProtocolError("not a JSON object")
    if "error" in chunk:
        err = chunk["error"]
        raise VllmProtocolError(str(err.get("message") if isinstance(err, dict) else err)[:500])
    choices = chunk.get("choices")
    if not isinstance(choices, list) or len(choices) > 1:
        raise VllmProtocolError("choices: not a list of at most one")
    if not choices:
        return [], None, None, None
    c = choices[0]
    if not isinstance(c, dict):
        raise VllmProtocolError("choices[0]: not an object")
    ids = c.get("token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise VllmProtocolError("choices[0].token_ids: not token ids of this model")
    finish = c.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise VllmProtocolError("choices[0].finish_reason: not a string")
    return ids, c.get("logprobs"), finish, c.get("stop_reason")


def parse_usage(chunk: dict) -> tuple[int, int, int] | None:
    """(prompt, cached, completion) tokens from a usage object, if there is one."""
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    values = (usage.get("prompt_tokens"), cached or 0, usage.get("completion_tokens"))
    if not all(isinstance(v, int) and v >= 0 for v in values):
        raise VllmProtocolError("usage: not token counts")
    return values  # type: ignore[return-value]


def error_message(data: Any) -> str:
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message", err))[:500]
        return str(err)[:500]
    return str(data)[:500]
