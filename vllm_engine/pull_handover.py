"""The KV handover seam for vLLM workers: a pull, as llm-d does it.

The decode side reserves nothing: its ticket only says "vLLM pull" (so a native prefill worker refuses it, and a
vLLM one refuses a native ticket). The prefill side runs the prompt on its vLLM server with `max_tokens` 1 and
`do_remote_decode`, which keeps the prompt's blocks and returns `kv_transfer_params` (where they are); those
travel back as the receipt. `admit` starts the request on the decode side's vLLM server with them: its
NixlConnector reads the blocks from the prefill server, and on a failed read recomputes the prompt
(`kv_load_failure_policy: recompute`). The decode server samples the first token itself (`streams_first_token`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.engine.interface import BadTicket, HandoverFailed, PrefillResult, Reservation
from splitserve.engine.outputs import RequestOutput
from splitserve.vllm_engine.engine import VllmEngine
from splitserve.vllm_engine.wire import VllmProtocolError

TICKET = json.dumps({"handover": "vllm-pull", "v": 1}).encode()
MAX_RECEIPT = 64 << 10  # bytes
_MAX_KEYS = 64
_MAX_LIST = 1 << 20  # items: block ids of a long prompt, per KV group


def check_ticket(ticket: bytes) -> None:
    try:
        doc = json.loads(ticket)
    except (ValueError, UnicodeDecodeError):
        raise BadTicket("the ticket is not JSON") from None
    if not isinstance(doc, dict) or doc.get("handover") != "vllm-pull":
        raise BadTicket("the ticket is not a vLLM pull ticket (the decode worker runs another engine)")
    if doc.get("v") != 1:
        raise BadTicket(f"vLLM pull ticket version {doc.get('v')!r}; this worker speaks 1")


def _plain(value: Any, depth: int = 0) -> bool:
    """JSON made of scalars and (nested, bounded) lists of them."""
    if value is None or isinstance(value, bool | int | float):
        return True
    if isinstance(value, str):
        return len(value) <= 1024
    if isinstance(value, list) and depth < 3:
        return len(value) <= _MAX_LIST and all(_plain(v, depth + 1) for v in value)
    return False


def parse_receipt(receipt: bytes) -> dict[str, Any]:
    """The kv_transfer_params a prefill worker returned, validated off the wire (raises `HandoverFailed`)."""
    if not receipt or len(receipt) > MAX_RECEIPT:
        raise HandoverFailed(f"a receipt of {len(receipt)} bytes (expected 1..{MAX_RECEIPT})")
    try:
        doc = json.loads(receipt)
    except (ValueError, UnicodeDecodeError):
        raise HandoverFailed("the receipt is not JSON") from None
    if not isinstance(doc, dict) or len(doc) > _MAX_KEYS:
        raise HandoverFailed("the receipt is not an object of kv_transfer_params")
    for key, value in doc.items():
        if not isinstance(key, str) or len(key) > 64 or not _plain(value):
            raise HandoverFailed(f"receipt field {str(key)[:64]!r} is not a plain value")
    if doc.get("do_remote_prefill") is not True:
        raise HandoverFailed("the receipt does not ask for a remote prefill (do_remote_prefill)")
    for key in ("remote_engine_id", "remote_host"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise HandoverFailed(f"receipt field {key!r} is missing")
    if not isinstance(doc.get("remote_port"), int) or not 0 < doc["remote_port"] < 65536:
        raise HandoverFailed("receipt field 'remote_port' is not a port")
    return doc


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    priority: int


class VllmDecodeHandover:
    """The decode side (see the module's docstring): nothing to reserve, nothing to free."""

    streams_first_token = True
    overlap_reserve = False  # reserve only looks the prompt up: nothing to overlap with the prefill call

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine
        self._pending: dict[str, _Pending] = {}

    async def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      priority: int = 0, *, min_remote_tokens: int = 1, timeout_s: float = 30.0) -> Reservation:
        cached = self.engine.cached_tokens(prompt_token_ids)
        if len(prompt_token_ids) - cached < min_remote_tokens:
            return Reservation(None, cached, "short_prompt")
        self._pending[request_id] = _Pending(list(prompt_token_ids), params, priority)
        return Reservation(TICKET, cached)

    async def landed(self, request_id: str) -> None:
        """Nothing lands before `admit`: the decode server pulls the KV when it starts the request."""
        if request_id not in self._pending:
            raise HandoverFailed(f"no reservation for {request_id!r}")

    def admit(self, request_id: str, first_token_id: int, first_logprob: Logprob | None = None,
              receipt: bytes = b"") -> AsyncIterator[RequestOutput]:
        pending = self._pending.pop(request_id, None)
        if pending is None:
            raise HandoverFailed(f"no reservation for {request_id!r}")
        params = parse_receipt(receipt)
        return self.engine.generate(request_id, pending.prompt, pending.params, pending.priority,
                                    kv_transfer_params=params)

    def cancel(self, request_id: str, prefill: Awaitable[object] | None = None) -> None:
        # The prefill server keeps the blocks it computed for a pull until the pull, or its own timeout
        # (VLLM_NIXL_ABORT_REQUEST_TIMEOUT); nothing here holds anything.
        self._pending.pop(request_id, None)

    async def close(self) -> None:
        self._pending.clear()


class VllmPrefillHandover:
    """The prefill side: compute the prompt on this worker's vLLM server, keep its KV there for the pull."""

    def __init__(self, engine: VllmEngine) -> None:
        self.engine = engine

    async def run(self, ticket: Awaitable[bytes], request_id: str, prompt_token_ids: Sequence[int],
                  params: SamplingParams) -> PrefillResult:
        """The ticket first (its decode side sends it with the request: it reserves nothing, see
        `VllmDecodeHandover.overlap_reserve`): a prefill whose KV nobody pulls would be held by its server."""
        check_ticket(await ticket)
        scheduled = time.monotonic()
        try:
            first, lp, cached, kv_params = await self.engine.complete_once(
                request_id, prompt_token_ids, params,
                kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                    "remote_engine_id": None, "remote_block_ids": None,
                                    "remote_host": None, "remote_port": None},
                timeout_s=self.engine.spec.kv_transfer.timeout_seconds)
        except (TimeoutError, httpx.HTTPError, VllmProtocolError) as e:
            raise HandoverFailed(f"vLLM prefill: {type(e).__name__}: {e}") from None
        if kv_params is None:
            raise HandoverFailed("the vLLM prefill returned no kv_transfer_params (is its NixlConnector on?)")
        receipt = json.dumps(kv_params).encode()
        parse_receipt(receipt)  # what the decode side will check: fail here, where the cause is
        done = time.monotonic()
        return PrefillResult(first, lp, cached, 0, scheduled, done, done, receipt)

    async def close(self) -> None:
        pass
