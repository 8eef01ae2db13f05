"""Fuzzing a real gateway in front of one real colocated SmolLM2 worker.

Over HTTP: requests generated from the gateway's own OpenAPI document (schema-valid ones must succeed, or fail
only on a cross-field rule the document describes) and malformed ones (wrong types, values out of range,
unknown fields, bodies that are not JSON or nest too deep, wrong methods and content types, unknown paths,
clients that hang up mid-stream), eight at a time. Over gRPC: random bytes and out-of-range fields to every
method of the worker. Nothing may answer 5xx or crash; afterwards the service still serves and the worker holds
no KV blocks. Generations are kept to a token or two so the whole run takes a minute or two on a laptop.
"""

from __future__ import annotations

import http.client
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from support.serving import Up

from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_MODEL_LEN = 256
MAX_BODY = 8192
BATCH = 8  # requests in flight at once
HTTP_EXAMPLES = 256  # x BATCH requests
GRPC_EXAMPLES = 120  # x BATCH messages
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json")
# 400s a schema-valid request may still get: rules between fields, which the document describes in words (and
# the prompt plus max_tokens within the context: code context_length_exceeded)
CROSS_FIELD = {"min_tokens", "top_logprobs", "stream_options", "max_tokens", "max_completion_tokens"}
CONFIG = f"""apiVersion: splitserve.dev/v1alpha1
kind: SplitServeCluster
metadata: {{name: fuzz}}
spec:
  model: {{maxModelLen: {MAX_MODEL_LEN}}}
  router: {{maxBodyBytes: {MAX_BODY}}}
"""


@pytest.fixture(scope="module")
def up():
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "fuzz.yaml"
        path.write_text(CONFIG)
        up = Up("-f", str(path), "--mode", "colocated", "--decode", "1")
        yield up
        assert up.stop() == 0


@pytest.fixture(scope="module")
def doc(up) -> dict:
    status, _, body = _send(up.port, "GET", "/openapi.json")
    assert status == 200
    return json.loads(body)


# -- HTTP ---------------------------------------------------------------------------------------------------
def _send(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
          hang_up: bool = False) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        if hang_up:  # read the first bytes of the stream, then go away
            data = resp.read1(64) if resp.status == 200 else resp.read()
        else:
            data = resp.read()
        return resp.status, dict(resp.getheaders()), data
    finally:
        conn.close()


@dataclass
class Call:
    method: str
    path: str
    body: bytes | None = None
    headers: dict = field(default_factory=dict)
    valid: bool = False  # schema-valid JSON body for this path
    hang_up: bool = False


ANY_TEXT = st.characters(exclude_categories=())  # lone surrogates too (JSON's \\ud800)
JSON_LEAF = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 300)
             | st.floats(allow_nan=True, allow_infinity=True) | st.text(ANY_TEXT, max_size=20))
JSON_ANY = st.recursive(JSON_LEAF, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(ANY_TEXT, max_size=8), c,
                                                                                        max_size=4), max_leaves=12)
SHORT_TEXT = st.text(st.characters(codec="utf-8"), max_size=40)


def from_schema(schema: dict, defs: dict, overrides: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy:
    """Values valid against `schema` (the subset of JSON Schema the gateway's document uses)."""
    overrides = overrides or {}
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, overrides)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, overrides) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind is None:
        return JSON_ANY
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, defs, overrides) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False)
    if kind == "string":
        return st.text(st.characters(codec="utf-8"), min_size=schema.get("minLength", 0),
                       max_size=max(schema.get("minLength", 0), 40))
    if kind == "array":
        lo = schema.get("minItems", 0)
        return st.lists(from_schema(schema.get("items", {}), defs, overrides), min_size=lo,
                        max_size=min(schema.get("maxItems", lo + 4), lo + 4))
    assert kind == "object", schema
    props = schema.get("properties", {})
    if not props:
        return st.just({}) if schema.get("maxProperties") == 0 else st.dictionaries(st.text(max_size=8), JSON_LEAF,
                                                                                     max_size=3)
    required = set(schema.get("required", ()))

    def strat(name: str) -> st.SearchStrategy:
        return overrides[name] if name in overrides else from_schema(props[name], defs, overrides)

    return st.fixed_dictionaries({k: strat(k) for k in props if k in required},
                                 optional={k: strat(k) for k in props if k not in required})


def _valid_body(doc: dict, name: str) -> st.SearchStrategy:
    """Schema-valid request bodies; generations kept to a token or two."""
    schemas = doc["components"]["schemas"]
    tiny = st.integers(1, 2)
    overrides = {"max_tokens": tiny, "max_completion_tokens": st.none() | tiny,
                 "min_tokens": st.none() | st.integers(0, 1)}
    body = from_schema(schemas[name], schemas, overrides)
    return body.map(lambda b: {**b, "max_tokens": b.get("max_tokens") or 1})  # never the default (the context)


# Values for the fields that bound the generation: none of them starts a long one
BAD_LENGTHS = st.sampled_from([0, -1, 1.5, "2", True, [], {}, 2**40, 2**64, float("nan"), float("inf")])


@st.composite
def _malformed(draw, doc: dict, name: str) -> dict | list | str | int | None:
    body = dict(draw(_valid_body(doc, name)))
    props = list(doc["components"]["schemas"][name]["properties"])
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["set", "set", "delete", "unknown", "unsupported"]))
        key = draw(st.sampled_from(props))
        if how == "set":
            body[key] = draw(BAD_LENGTHS if key in ("max_tokens", "max_completion_tokens") else JSON_ANY)
        elif how == "delete" and key not in ("max_tokens",):
            body.pop(key, None)
        elif how == "unknown":
            body[draw(st.text(ANY_TEXT, min_size=1, max_size=12))] = draw(JSON_LEAF)
        else:
            body[draw(st.sampled_from(["tools", "suffix", "functions", "audio"]))] = draw(JSON_LEAF)
    return body


SURROGATES = [json.dumps(b).replace("@", "\\ud800").encode() for b in (
    {"model": MODEL, "prompt": "a@", "max_tokens": 1}, {"model": MODEL, "prompt": ["@"], "max_tokens": 1},
    {"model": MODEL, "messages": [{"role": "user", "content": "@"}], "max_tokens": 1},
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "@"}]}], "max_tokens": 1},
    {"model": MODEL, "prompt": "a", "stop": ["@"], "max_tokens": 1}, {"model": MODEL, "prompt": "a", "user": "@"},
    {"model": "@", "prompt": "a"}, {"model": MODEL, "prompt": "a", "@": 1}, {"model": MODEL, "prompt": "a", "n": "@"})]
_VALIDATORS: dict[str, Draft202012Validator] = {}


def _validator(doc: dict, name: str) -> Draft202012Validator:
    if name not in _VALIDATORS:
        _VALIDATORS[name] = Draft202012Validator(doc["components"]["schemas"][name])
    return _VALIDATORS[name]


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


@st.composite
def http_call(draw, doc: dict) -> Call:
    kind = draw(st.sampled_from(["valid", "valid", "malformed", "malformed", "malformed", "raw", "method", "get",
                                 "path", "content", "hang_up"]))
    post = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest"}
    path = draw(st.sampled_from(sorted(post)))
    json_headers = {"Content-Type": "application/json"}
    if kind == "valid":
        body = draw(_valid_body(doc, post[path]))
        _validator(doc, post[path]).validate(body)  # the strategies make what the document describes
        headers = json_headers | draw(st.sampled_from([{}, {"x-session-id": "s1"}, {"Authorization": "Bearer x"}]))
        return Call("POST", path, json.dumps(body).encode(), headers, valid=True)
    if kind == "malformed":
        body = draw(_malformed(doc, post[path]) | JSON_ANY)
        return Call("POST", path, json.dumps(body).encode(), json_headers)
    if kind == "raw":
        raw = draw(st.binary(max_size=200) | st.sampled_from([
            b"", b"{", b"nul", b'{"model": "smollm2", "messages": [', b"\xff\xfe{}", b'"\\ud800"', b"NaN",
            *SURROGATES,
            _deep(50_000)[:MAX_BODY - 2], b'{"a":' * 1200 + b"1" + b"}" * 1200, b"[" * 4000 + b"]" * 4000,
            b" " * (MAX_BODY + 1), json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY}).encode()]))
        return Call("POST", path, raw, json_headers)
    if kind == "method":
        return Call(draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])),
                    draw(st.sampled_from(PATHS)), None)
    if kind == "get":
        query = draw(st.sampled_from(["", "?a=1", "?model=x&stream=true", "?%ff=%00", "?" + "q" * 2000]))
        return Call(draw(st.sampled_from(["GET", "HEAD", "POST"])), draw(st.sampled_from(PATHS[2:])) + query, b"{}")
    if kind == "path":
        junk = draw(st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30))
        return Call("POST", draw(st.sampled_from(["/", "/v1", "/v1/", "/v2/completions", "/v1/chat/completions/",
                                                  "/../v1/models", "/v1/%2e%2e/health"])) + junk.replace(" ", ""),
                    b"{}", json_headers)
    if kind == "content":
        body = json.dumps(draw(_valid_body(doc, post[path]))).encode()
        ctype = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "application/json; x=y",
                                      "APPLICATION/JSON", "", "multipart/form-data; boundary=x"]))
        headers = {"Content-Type": ctype} if ctype else {}
        if draw(st.booleans()):
            headers["Content-Length"] = str(draw(st.sampled_from([10**12, MAX_BODY * 2])))
            body = b""
        return Call("POST", path, body, headers)
    body = {"model": MODEL, "max_tokens": 40, "ignore_eos": True, "stream": True}  # hang up mid-stream
    body |= {"messages": [{"role": "user", "content": "Count to fifty."}]} if "chat" in path else {"prompt": "1, 2,"}
    return Call("POST", path, json.dumps(body).encode(), json_headers, hang_up=True)


class Tally:
    def __init__(self) -> None:
        self.sent = 0
        self.by_status: dict[int, int] = {}


def _check(port: int, call: Call, tally: Tally, failures: list[str]) -> None:
    headers = dict(call.headers)
    if call.body is not None and "Content-Length" not in headers:
        headers["Content-Length"] = str(len(call.body))
    status, resp_headers, data = _send(port, call.method, call.path, call.body, headers, call.hang_up)
    tally.sent += 1
    tally.by_status[status] = tally.by_status.get(status, 0) + 1
    what = f"{call.method} {call.path} {(call.body or b'')[:300]!r} -> {status} {data[:300]!r}"
    if status >= 500:
        failures.append(what)
        return
    if call.hang_up or call.method == "HEAD":
        return
    if status >= 400:
        err = json.loads(data)["error"]
        assert err["message"] and err["type"], what
        cross_field = err["param"] in CROSS_FIELD or err["code"] == "context_length_exceeded"
        if call.valid and not (status == 400 and cross_field):
            failures.append("schema-valid request refused: " + what)
        return
    if resp_headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
        if events[-1] != "[DONE]" or any('"error"' in e and e.startswith('{"error"') for e in events):
            failures.append("stream failed: " + what)


def test_openapi_document_describes_every_endpoint(doc):
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == set(PATHS)
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        Draft202012Validator.check_schema(schemas[name])
        assert schemas[name]["additionalProperties"] is False
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    assert chat["model"]["enum"] == [MODEL]


def test_fuzz_http_no_5xx_and_still_serving(up, doc):
    tally = Tally()
    pool = ThreadPoolExecutor(BATCH)

    @settings(max_examples=HTTP_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(st.lists(http_call(doc), min_size=BATCH, max_size=BATCH))
    def run(calls: list[Call]) -> None:
        failures: list[str] = []
        for f in [pool.submit(_check, up.port, c, tally, failures) for c in calls]:
            f.result()
        assert not failures, failures[:5]

    t0 = time.monotonic()
    try:
        run()
    finally:
        pool.shutdown()
    print(f"{tally.sent} requests in {time.monotonic() - t0:.0f} s: {sorted(tally.by_status.items())}")
    assert tally.sent >= 2000
    assert tally.by_status.get(200, 0) >= 300  # the valid ones did generate
    _still_serving(up)


def _still_serving(up: Up) -> None:
    assert up.proc.poll() is None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    status, _, data = _send(up.port, "POST", "/v1/chat/completions", json.dumps(body).encode(),
                            {"Content-Type": "application/json"})
    assert status == 200 and json.loads(data)["choices"][0]["message"]["content"]
    assert _send(up.port, "GET", "/health")[0] == 200
    deadline = time.monotonic() + 30
    while True:  # aborted requests leave the engine, then their gRPC call, within a step or two
        stats = up.stats("decode")
        if stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == stats["outstanding_requests"] == 0:
            break
        assert time.monotonic() < deadline, f"KV blocks or calls still held after the fuzz: {stats}"
        time.sleep(0.2)
    os.kill(up.components["decode"][0]["pid"], 0)  # the worker process is alive


# -- gRPC ---------------------------------------------------------------------------------------------------
U32 = st.integers(0, 2**32 - 1)
I32 = st.integers(-(2**31), 2**31 - 1)
FLOAT = st.floats(width=32, allow_nan=True, allow_infinity=True)
TEXT = st.text(max_size=300)


@st.composite
def sampling_pb(draw) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=draw(st.sampled_from([0, 1, 2])), temperature=draw(FLOAT), top_p=draw(FLOAT),
        top_k=draw(I32), has_seed=draw(st.booleans()), seed=draw(st.integers(0, 2**64 - 1)),
        stop=draw(st.lists(st.text(max_size=5), max_size=20)), stop_token_ids=draw(st.lists(U32, max_size=5)),
        ignore_eos=draw(st.booleans()), want_logprobs=draw(st.booleans()), top_logprobs=draw(U32),
        min_tokens=draw(U32 | st.integers(0, 2)), include_stop_str_in_output=draw(st.booleans()),
        output_offset=draw(U32))


@st.composite
def grpc_call(draw) -> tuple[str, bool, bytes]:
    """(method, streaming, serialized request)."""
    method = draw(st.sampled_from(["Generate", "Generate", "Prefill", "Abort", "Health", "Stats"]))
    if draw(st.integers(0, 3)) == 0:
        raw = draw(st.binary(max_size=300) | st.sampled_from([b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x02\xff\xfe",
                                                               b"\xff" * 20, b"\x08" + b"\x80" * 11]))
        return method, method == "Generate", raw
    prompt = st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 500), max_size=MAX_MODEL_LEN + 10)
    version = st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, 2**32 - 1])
    rid = st.just("r") | TEXT | st.text(st.characters(max_codepoint=31), max_size=3)
    if method == "Generate":
        msg = pb.GenerateRequest(protocol_version=draw(version), request_id=draw(rid), prompt_token_ids=draw(prompt),
                                 params=draw(sampling_pb()), prefill_worker=draw(TEXT), priority=draw(I32))
    elif method == "Prefill":
        msg = pb.PrefillRequest(protocol_version=draw(version), request_id=draw(rid), prompt_token_ids=draw(prompt),
                                params=draw(sampling_pb()), ticket=draw(st.binary(max_size=100)))
    elif method == "Abort":
        msg = pb.AbortRequest(request_id=draw(rid))
    else:
        msg = pb.HealthRequest() if method == "Health" else pb.StatsRequest()
    return method, method == "Generate", msg.SerializeToString()


GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.ALREADY_EXISTS}


def _grpc_check(channel: grpc.Channel, call: tuple[str, bool, bytes], failures: list[str]) -> None:
    method, streaming, raw = call
    path = f"/splitserve.v1.Worker/{method}"
    try:
        if streaming:
            for _ in channel.unary_stream(path)(raw, timeout=60):
                pass
        else:
            channel.unary_unary(path)(raw, timeout=60)
    except grpc.RpcError as e:
        if e.code() not in GRPC_OK:
            failures.append(f"{method} {raw[:200]!r} -> {e.code()} {e.details()}")


def test_fuzz_grpc_invalid_argument_never_a_crash(up):
    endpoint = up.components["decode"][0]["grpc"]
    sent = 0
    t0 = time.monotonic()
    with grpc.insecure_channel(endpoint) as channel, ThreadPoolExecutor(BATCH) as pool:
        @settings(max_examples=GRPC_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(grpc_call(), min_size=BATCH, max_size=BATCH))
        def run(calls) -> None:
            nonlocal sent
            failures: list[str] = []
            for f in [pool.submit(_grpc_check, channel, c, failures) for c in calls]:
                f.result()
            sent += len(calls)
            assert not failures, failures[:5]

        run()
    print(f"{sent} gRPC messages in {time.monotonic() - t0:.0f} s")
    assert sent >= GRPC_EXAMPLES * BATCH
    _still_serving(up)


def test_nan_is_not_a_number_the_gateway_takes(up):
    """Python's json reads NaN and Infinity; every numeric field refuses them."""
    for name in ("temperature", "top_p", "max_tokens", "seed", "top_k"):
        body = b'{"model": "smollm2", "prompt": "a", "max_tokens": 1, "' + name.encode() + b'": NaN}'
        status, _, data = _send(up.port, "POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert status == 400 and json.loads(data)["error"]["param"] == name, data


def test_a_request_id_already_in_use_is_refused_not_a_failure(up):
    endpoint = up.components["decode"][0]["grpc"]
    msg = pb.GenerateRequest(protocol_version=PROTOCOL_VERSION, request_id="twice", prompt_token_ids=[1, 2, 3] * 20,
                             params=pb.SamplingParams(max_tokens=30, ignore_eos=True, top_p=1.0))
    with grpc.insecure_channel(endpoint) as channel:
        generate = channel.unary_stream("/splitserve.v1.Worker/Generate")
        first = generate(msg.SerializeToString(), timeout=120)
        next(first)  # running
        with pytest.raises(grpc.RpcError) as e:
            list(generate(msg.SerializeToString(), timeout=60))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
        assert pb.GenerateResponse.FromString(next(first)).token_ids  # the first one goes on
        first.cancel()
    _still_serving(up)
