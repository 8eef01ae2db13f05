"""The gateway's OpenAPI 3.1 document (`GET /openapi.json`), built from the request parser's own tables
(`openai_protocol`: the fields each endpoint takes, their ranges), so what it publishes is what the gateway checks.

Cross-field rules a schema cannot say (the prompt plus `max_tokens` within the context, `min_tokens` at most
`max_tokens`, `top_logprobs` only with `logprobs`) are in the descriptions; breaking one is a 400 that names it.
"""

from __future__ import annotations

from typing import Any

from splitserve.router import openai_protocol as op

SCHEMA_REF = "#/components/schemas/"


def _nullable(schema: dict) -> dict:
    """The parser treats null as absent for every optional field."""
    return {"anyOf": [schema, {"type": "null"}]}


def _range(name: str, rng: op.Range) -> dict:
    integer, lo, hi = rng
    out: dict[str, Any] = {"type": "integer" if integer else "number", "minimum": int(lo) if integer else lo}
    if hi is not None:
        out["maximum"] = int(hi) if integer else hi
    return out


NON_EMPTY = {"type": "string", "minLength": 1}
TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
MESSAGE = {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": list(op.MESSAGE_ROLES)},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}},
}
STOP = {"anyOf": [NON_EMPTY, {"type": "array", "items": NON_EMPTY, "maxItems": op.MAX_STOP}]}
STREAM_OPTIONS = {"type": "object", "additionalProperties": False,
                  "properties": {"include_usage": {"type": "boolean"}, "continuous_usage_stats": {}}}
ANY = {"description": "accepted; no effect"}

# Fields other than the numeric ones of the parser's range tables (which `_range` turns into schemas).
OTHER_FIELDS: dict[str, dict] = {
    "stop": {**STOP, "description": f"a string or up to {op.MAX_STOP} strings that end the completion"},
    "stream": {"type": "boolean"},
    "stream_options": {**STREAM_OPTIONS, "description": "only with stream: true"},
    "n": {"const": 1, "description": "one choice per request"},
    "presence_penalty": {"const": 0},
    "frequency_penalty": {"const": 0},
    "logit_bias": {"type": "object", "maxProperties": 0},
    "ignore_eos": {"type": "boolean"},
    "user": {"type": "string", "description": "also the routing session key"},
    "metadata": ANY,
    "store": ANY,
    "reasoning_effort": ANY,
    "service_tier": ANY,
    "response_format": {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
    "echo": {"const": False},
    "best_of": {"const": 1},
}
DESCRIPTIONS = {
    "max_tokens": "tokens to generate; the prompt plus max_tokens must fit the model's context (see /v1/models)",
    "max_completion_tokens": "the same as max_tokens (the first given wins)",
    "min_tokens": "at most max_tokens",
    "top_k": "-1 or 0: off",
    "seed": "the same seed gives the same completion on the same hardware, wherever it runs",
    "priority": "lower runs first (under the priority scheduling policy)",
    "top_logprobs": "needs logprobs: true",
    "logprobs": "chosen token plus this many alternatives",
}


def _properties(allowed: set[str], ranges: dict[str, op.Range]) -> dict[str, dict]:
    props = {}
    for name in sorted(allowed - op.UNSUPPORTED - {"model", "messages", "prompt"}):
        if name in ranges or name in op.RANGES:
            schema = _range(name, ranges.get(name) or op.RANGES[name])
        elif name == "logprobs":  # chat: a boolean
            schema = {"type": "boolean", "description": "return the chosen tokens' log-probabilities"}
        else:
            schema = dict(OTHER_FIELDS[name])
        if name in DESCRIPTIONS:
            schema.setdefault("description", DESCRIPTIONS[name])
        props[name] = _nullable(schema)
    return props


def request_schemas(model_names: list[str], vocab_size: int) -> dict[str, dict]:
    model = {"type": "string", "enum": model_names}
    chat = {
        "type": "object", "additionalProperties": False, "required": ["model", "messages"],
        "properties": {"model": model, "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
                       **_properties(op.COMMON | op.CHAT_ONLY, op.CHAT_RANGES)},
    }
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    prompt = {"anyOf": [NON_EMPTY, token_ids, {"type": "array", "items": NON_EMPTY, "minItems": 1, "maxItems": 1},
                        {"type": "array", "items": token_ids, "minItems": 1, "maxItems": 1}]}
    completion = {
        "type": "object", "additionalProperties": False, "required": ["model", "prompt"],
        "properties": {"model": model, "prompt": prompt,
                       **_properties(op.COMMON | op.COMPLETION_ONLY, op.COMPLETION_RANGES)},
    }
    return {"ChatCompletionRequest": chat, "CompletionRequest": completion}


ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    what = {400: "invalid request (the message names the field)", 401: "missing or wrong API key",
            404: "unknown model", 413: "body over the size limit", 415: "Content-Type is not application/json",
            429: "too many requests queued (Retry-After)", 503: "no worker can take it now"}
    return {str(c): _json({"$ref": SCHEMA_REF + "Error"}, what[c]) for c in codes}


def _completion_op(summary: str, schema: str, max_body_bytes: int) -> dict:
    return {
        "summary": summary,
        "requestBody": {"required": True, "description": f"at most {max_body_bytes} bytes",
                        "content": {"application/json": {"schema": {"$ref": SCHEMA_REF + schema}}}},
        "responses": {"200": {"description": "the completion (JSON), or server-sent events with stream: true",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      **_errors(400, 401, 404, 413, 415, 429, 503)},
    }


def document(model_names: list[str], vocab_size: int, max_body_bytes: int, version: str) -> dict:
    schemas = request_schemas(model_names, vocab_size) | {"Error": ERROR}
    return {
        "openapi": "3.1.0",
        "info": {"title": "splitserve gateway", "version": version,
                 "description": "OpenAI-compatible completions over disaggregated prefill/decode workers."},
        "paths": {
            "/v1/chat/completions": {"post": _completion_op("Chat completion", "ChatCompletionRequest",
                                                            max_body_bytes)},
            "/v1/completions": {"post": _completion_op("Text completion", "CompletionRequest", max_body_bytes)},
            "/v1/models": {"get": {"summary": "The served model", "responses": {
                "200": _json({"type": "object", "required": ["object", "data"]}, "the model list"),
                **_errors(401)}}},
            "/health": {"get": {"summary": "Whether the gateway can serve, and its view of the workers", "responses": {
                "200": _json({"type": "object"}, "can serve"), "503": _json({"type": "object"}, "cannot serve")}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "text exposition format", "content": {"text/plain": {"schema": {
                    "type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {
                "200": _json({"type": "object"}, "OpenAPI 3.1")}}},
        },
        "components": {"schemas": schemas,
                       "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                                      "description": "when the gateway has API keys"}}},
    }
