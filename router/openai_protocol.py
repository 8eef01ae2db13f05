"""Parsing and validating OpenAI chat/completions requests into one internal `GenerationSpec`.

Every field is either supported, explicitly unsupported (400 naming it), or unknown (400 naming it): nothing
is silently ignored, except `user` and `metadata`, which carry no behaviour. The ranges below are what the
gateway's OpenAPI document (`openapi.py`) publishes: one table for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from splitserve.common.sampling import MAX_SEED, SamplingParams, random_seed
from splitserve.router.errors import APIError, bad

COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
          "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "ignore_eos", "min_tokens", "metadata",
          "priority"}
CHAT_ONLY = {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "functions",
             "function_call", "response_format", "parallel_tool_calls", "store", "modalities", "audio",
             "reasoning_effort", "service_tier", "prediction", "web_search_options"}
COMPLETION_ONLY = {"prompt", "logprobs", "echo", "best_of", "suffix"}
UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "modalities", "audio",
               "prediction", "web_search_options", "suffix"}

# Numeric fields: name -> (integer?, lowest, highest; None: bounded per request). `_num` and `_int` check these.
Range = tuple[bool, float, float | None]
RANGES: dict[str, Range] = {
    "temperature": (False, 0.0, 2.0),
    "top_p": (False, 1e-9, 1.0),
    "top_k": (True, -1, 1 << 20),
    "seed": (True, 0, MAX_SEED),
    "priority": (True, -1000, 1000),
    "max_tokens": (True, 1, None),  # at most the context left after the prompt
    "max_completion_tokens": (True, 1, None),
    "min_tokens": (True, 0, None),  # at most max_tokens
}
CHAT_RANGES: dict[str, Range] = {"top_logprobs": (True, 0, 20)}
COMPLETION_RANGES: dict[str, Range] = {"logprobs": (True, 0, 5)}
MAX_STOP = 16
MESSAGE_ROLES = ("system", "user", "assistant", "developer")


@dataclass
class GenerationSpec:
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    chat: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    priority: int = 0
    session_key: str | None = None  # the OpenAI `user` field or the session header: routing affinity


def _num(body: dict, name: str, default: float) -> float:
    _, lo, hi = RANGES[name]
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad(f"'{name}' must be a number in [{lo}, {hi}]", name)
    return float(v)


def _int(body: dict, name: str, default: int | None, hi: int | None = None,
         ranges: dict[str, Range] = RANGES) -> int | None:
    """`hi`: this request's own bound, for a field the table leaves open."""
    _, lo, top = ranges[name]
    lo, hi = int(lo), int(hi if top is None else top)
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(f"'{name}' must be an integer in [{lo}, {hi}]", name)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return v


def _unicode(text: str, param: str) -> str:
    """JSON's \\u escapes can make lone surrogates, which no tokenizer or protobuf string takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"'{param}' is not valid Unicode (a lone surrogate at {e.start})", param) from None
    return text


def check_fields(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    for k in body:
        if k in UNSUPPORTED:
            raise bad(f"'{k}' is not supported by this server", k, code="unsupported_parameter")
        if k not in allowed:
            raise bad(f"Unrecognized request argument supplied: {k}", k)
    if body.get("n") not in (None, 1):
        raise bad("only n=1 is supported", "n", code="unsupported_parameter")
    for pen in ("presence_penalty", "frequency_penalty"):
        if body.get(pen) not in (None, 0, 0.0):
            raise bad(f"'{pen}' is not supported (only 0)", pen, code="unsupported_parameter")
    if body.get("logit_bias") not in (None, {}):
        raise bad("'logit_bias' is not supported", "logit_bias", code="unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise bad("only best_of=1 is supported", "best_of", code="unsupported_parameter")
    if body.get("echo") not in (None, False):
        raise bad("'echo' is not supported", "echo", code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("only response_format {'type': 'text'} is supported", "response_format", code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string", "model")
    return body


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in stop):
        raise bad(f"'stop' must be a non-empty string or a list of up to {MAX_STOP} non-empty strings", "stop")
    return [_unicode(s, "stop") for s in stop]


def _stream_options(body: dict, stream: bool) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}:
        raise bad("'stream_options' must be an object with 'include_usage'", "stream_options")
    v = so.get("include_usage", False)
    if not isinstance(v, bool):
        raise bad("'stream_options.include_usage' must be a boolean", "stream_options")
    return v


def chat_messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in MESSAGE_ROLES:
            raise bad(f"messages[{i}] must be an object with role system, user, assistant or developer", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(p["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        _unicode(content, "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def sampling(body: dict, prompt_len: int, max_model_len: int, chat: bool) -> tuple[SamplingParams, int]:
    """Sampling params and the top-logprobs count; checks prompt + max_tokens against the context."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise bad(f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len}",
                  "messages" if chat else "prompt", code="context_length_exceeded")
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = None
    for name in names:
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad(f"'{name}' must be an integer", name)
        if v < 1:
            raise bad(f"'{name}' must be at least 1", name)
        max_tokens = max_tokens or v
    if max_tokens is None:
        max_tokens = room if chat else 16
    if max_tokens > room:
        raise bad(f"'max_tokens' is too large: prompt ({prompt_len}) + max_tokens ({max_tokens}) exceeds the context "
                  f"length {max_model_len}", names[-1], code="context_length_exceeded")
    if chat:
        want_lp = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, ranges=CHAT_RANGES)
        if top and not want_lp:
            raise bad("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        lp = top if want_lp else None
    else:
        lp = _int(body, "logprobs", None, ranges=COMPLETION_RANGES)
        top = lp or 0
    temperature = _num(body, "temperature", 1.0)
    top_k = _int(body, "top_k", 0)
    seed = _int(body, "seed", None)
    if seed is None and temperature >= SamplingParams.MIN_TEMPERATURE and top_k != 1:
        seed = random_seed()  # a sampled request is seeded here, so whichever worker samples a position draws the same
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=_num(body, "top_p", 1.0),
            top_k=top_k,
            seed=seed,
            stop=_stop(body),
            ignore_eos=_bool(body, "ignore_eos"),
            min_tokens=_int(body, "min_tokens", 0, hi=max_tokens),
            logprobs=lp,
        )
    except ValueError as e:
        raise bad(str(e)) from None
    return params, top


def _check_chars(n: int, max_chars: int | None, max_model_len: int, param: str) -> None:
    """Refuse a prompt too long to fit before paying for its tokenization."""
    if max_chars is not None and n > max_chars:
        raise bad(f"This model's maximum context length is {max_model_len} tokens; the prompt has {n} characters "
                  f"(at most {max_chars} are accepted)", param, code="context_length_exceeded")


def parse(body: Any, chat: bool, tokenizer, max_model_len: int, model_names: set[str],
          max_prompt_chars: int | None = None) -> GenerationSpec:
    check_fields(body, COMMON | (CHAT_ONLY if chat else COMPLETION_ONLY))
    if body["model"] not in model_names:
        raise APIError(404, f"The model '{body['model']}' does not exist", "model", "invalid_request_error",
                       "model_not_found")
    stream = _bool(body, "stream")
    include_usage = _stream_options(body, stream)
    if chat:
        messages = chat_messages(body)
        _check_chars(sum(len(msg["content"]) for msg in messages), max_prompt_chars, max_model_len, "messages")
        try:
            prompt = tokenizer.apply_chat_template(messages)
        except Exception as e:
            raise bad(f"could not apply the chat template: {e}", "messages") from None
    else:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str):
            _check_chars(len(p), max_prompt_chars, max_model_len, "prompt")
        prompt = completion_prompt(body, tokenizer)
    params, top = sampling(body, len(prompt), max_model_len, chat)
    priority = _int(body, "priority", 0)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("'user' must be a string", "user")
    if user:
        _unicode(user, "user")
    return GenerationSpec(prompt, params, stream, include_usage, chat, params.logprobs is not None, top, priority,
                          user or None)


def completion_prompt(body: dict, tokenizer) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' must not be empty", "prompt")
        return tokenizer.encode(_unicode(p, "prompt"))
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if any(not 0 <= t < tokenizer.vocab_size for t in p):
            raise bad(f"'prompt' token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return list(p)
    if isinstance(p, list) and len(p) > 1:
        raise bad("only one prompt per request is supported", "prompt", code="unsupported_parameter")
    raise bad("'prompt' must be a string, a list of token ids, or a one-element list of either", "prompt")
