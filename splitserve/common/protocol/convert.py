"""Between protobuf messages and the worker protocol's dataclasses (`splitserve.common.worker_messages`), both
ways: what a caller sends and reads (`GrpcWorkerClient`), what a worker reads and sends (`protocol.server`).
A worker validates every field it receives here (`InvalidRequest` names the field); what depends on its model
(context length, vocabulary) its role checks (`worker_messages.check_prompt`)."""

from __future__ import annotations

from splitserve.common.engines import DEFAULT_ENGINE, ENGINES
from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.sampling import Logprob, SamplingParams
from splitserve.common.worker_messages import (
    CAPABILITIES,
    MAX_FLIP_DRAIN_SECONDS,
    ROLE_FLIP_ROLES,
    FlipCall,
    FlipReply,
    GenerateCall,
    GenerateChunk,
    HealthReport,
    InvalidRequest,
    LoadReport,
    PrefillCall,
    PrefillReply,
    RetryReason,
    WorkerCallError,
)

MAX_REQUEST_ID = 256
MAX_PROMPT_TOKENS = 1 << 20


# == what a worker receives: validated ==========================================================================
def _check_request(protocol_version: int, request_id: str, num_prompt_tokens: int) -> None:
    if protocol_version != PROTOCOL_VERSION:
        raise InvalidRequest(f"protocol_version {protocol_version} is not supported (this worker speaks "
                             f"{PROTOCOL_VERSION})")
    if not request_id or len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
        raise InvalidRequest("request_id: 1-256 printable characters")
    if num_prompt_tokens > MAX_PROMPT_TOKENS:
        raise InvalidRequest(f"prompt_token_ids: {num_prompt_tokens} tokens, more than {MAX_PROMPT_TOKENS}")


def generate_call_from_pb(m: pb.GenerateRequest) -> GenerateCall:
    _check_request(m.protocol_version, m.request_id, len(m.prompt_token_ids))
    return GenerateCall(m.request_id, list(m.prompt_token_ids), params_from_pb(m.params), m.prefill_worker,
                        m.priority, list(m.resume_token_ids))


def prefill_call_from_pb(m: pb.PrefillRequest) -> PrefillCall:
    _check_request(m.protocol_version, m.request_id, len(m.prompt_token_ids))
    return PrefillCall(m.request_id, list(m.prompt_token_ids), params_from_pb(m.params), m.ticket)


def flip_call_from_pb(m: pb.FlipRequest) -> FlipCall:
    if m.protocol_version != PROTOCOL_VERSION:
        raise InvalidRequest(f"protocol_version {m.protocol_version} is not supported (this worker speaks "
                             f"{PROTOCOL_VERSION})")
    if m.role not in ROLE_FLIP_ROLES:
        raise InvalidRequest(f"role: {m.role[:32]!r} is not one of prefill, decode")
    if not 0 <= m.drain_seconds <= MAX_FLIP_DRAIN_SECONDS:  # NaN fails too
        raise InvalidRequest(f"drain_seconds: {m.drain_seconds} is not within 0..{MAX_FLIP_DRAIN_SECONDS:g}")
    return FlipCall(m.role, m.drain_seconds)


def params_from_pb(m: pb.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=m.max_tokens, temperature=m.temperature, top_p=m.top_p, top_k=m.top_k,
            seed=m.seed if m.has_seed else None, stop=list(m.stop), stop_token_ids=list(m.stop_token_ids),
            ignore_eos=m.ignore_eos, logprobs=m.top_logprobs if m.want_logprobs else None,
            min_tokens=m.min_tokens, include_stop_str_in_output=m.include_stop_str_in_output,
            output_offset=m.output_offset,
        )
    except ValueError as e:
        raise InvalidRequest(f"params: {e}") from None


# == what a worker sends ========================================================================================
def chunk_to_pb(c: GenerateChunk) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=c.request_id, token_ids=c.token_ids, logprobs=[logprob_to_pb(lp) for lp in c.logprobs],
        finished=c.finished, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        prompt_tokens=c.prompt_tokens, cached_tokens=c.cached_tokens, completion_tokens=c.completion_tokens,
        error=c.error, remote_prefill=c.remote_prefill, retry=c.retry or "")


def prefill_reply_to_pb(request_id: str, r: PrefillReply) -> pb.PrefillResponse:
    lp = r.first_logprob
    return pb.PrefillResponse(request_id=request_id, first_token_id=r.first_token_id, has_logprob=lp is not None,
                              first_logprob=logprob_to_pb(lp) if lp is not None else None,
                              cached_tokens=r.cached_tokens, kv_bytes=r.kv_bytes, receipt=r.receipt)


def health_to_pb(h: HealthReport) -> pb.HealthResponse:
    return pb.HealthResponse(live=h.live, ready=h.ready, role=h.role, draining=h.draining, model=h.model,
                             protocol_version=h.protocol_version, engine=h.engine,
                             capabilities=sorted(h.capabilities), kv_connector=h.kv_connector,
                             kv_transports=h.kv_transports)


def flip_reply_to_pb(r: FlipReply) -> pb.FlipResponse:
    return pb.FlipResponse(role=r.role, previous=r.previous, seconds=r.seconds, moved_streams=r.moved_streams)


def load_to_pb(r: LoadReport) -> pb.StatsResponse:
    return pb.StatsResponse(
        num_waiting=r.num_waiting, num_running=r.num_running, kv_blocks_used=r.kv_blocks_used,
        kv_blocks_total=r.kv_blocks_total, tokens_in_flight=r.tokens_in_flight,
        num_waiting_remote_kv=r.num_waiting_remote_kv, num_held=r.num_held,
        outstanding_requests=r.outstanding_requests)


# == what a caller sends ========================================================================================
def generate_call_to_pb(c: GenerateCall) -> pb.GenerateRequest:
    return pb.GenerateRequest(protocol_version=PROTOCOL_VERSION, request_id=c.request_id,
                              prompt_token_ids=c.prompt_token_ids, params=params_to_pb(c.params),
                              prefill_worker=c.prefill_worker, priority=c.priority,
                              resume_token_ids=c.resume_token_ids)


def prefill_call_to_pb(c: PrefillCall) -> pb.PrefillRequest:
    return pb.PrefillRequest(protocol_version=PROTOCOL_VERSION, request_id=c.request_id,
                             prompt_token_ids=c.prompt_token_ids, params=params_to_pb(c.params), ticket=c.ticket)


def flip_call_to_pb(c: FlipCall) -> pb.FlipRequest:
    return pb.FlipRequest(protocol_version=PROTOCOL_VERSION, role=c.role, drain_seconds=c.drain_seconds)


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        has_seed=p.seed is not None, seed=p.seed or 0, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, want_logprobs=p.logprobs is not None, top_logprobs=p.logprobs or 0,
        min_tokens=p.min_tokens, include_stop_str_in_output=p.include_stop_str_in_output,
        output_offset=p.output_offset,
    )


# == what a caller reads ========================================================================================
def chunk_from_pb(m: pb.GenerateResponse) -> GenerateChunk:
    return GenerateChunk(
        m.request_id, list(m.token_ids), [logprob_from_pb(lp) for lp in m.logprobs], m.finished, m.finish_reason,
        m.stop_reason, m.prompt_tokens, m.cached_tokens, m.completion_tokens, m.error, m.remote_prefill,
        _retry_from_pb(m.retry))


def _retry_from_pb(retry: str) -> RetryReason | None:
    """A worker says drain, engine or busy; any other word (from a later release) still lets the request move."""
    if not retry:
        return None
    return RetryReason(retry) if retry in (RetryReason.DRAIN, RetryReason.BUSY) else RetryReason.ENGINE


def prefill_reply_from_pb(m: pb.PrefillResponse) -> PrefillReply:
    return PrefillReply(m.first_token_id, logprob_from_pb(m.first_logprob) if m.has_logprob else None,
                        m.cached_tokens, m.kv_bytes, m.receipt)


def health_from_pb(m: pb.HealthResponse) -> HealthReport:
    return HealthReport(m.live, m.ready, m.role, m.draining, m.model, m.protocol_version,
                        m.engine if m.engine in ENGINES else DEFAULT_ENGINE,
                        frozenset(c for c in m.capabilities if c in CAPABILITIES),
                        m.kv_connector[:32], {k[:256]: v[:32] for k, v in list(m.kv_transports.items())[:256]})


def load_from_pb(m: pb.StatsResponse) -> LoadReport:
    return LoadReport(m.num_waiting, m.num_running, m.kv_blocks_used, m.kv_blocks_total, m.tokens_in_flight,
                      m.num_waiting_remote_kv, m.num_held, m.outstanding_requests)


def flip_reply_from_pb(m: pb.FlipResponse) -> FlipReply:
    """Raises `WorkerCallError` (failed) on an answer that is not a flip's: a role that is none, a time that is not
    a number of seconds."""
    if m.role not in ROLE_FLIP_ROLES or m.previous not in ROLE_FLIP_ROLES or not 0 <= m.seconds < 1e6:
        raise WorkerCallError("failed", f"the worker's flip answer does not validate (role {m.role[:32]!r}, "
                                        f"previous {m.previous[:32]!r}, seconds {m.seconds})")
    return FlipReply(m.role, m.previous, m.seconds, m.moved_streams)


# == both ways ==================================================================================================
def logprob_to_pb(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_pb(m: pb.TokenLogprob) -> Logprob:
    return Logprob(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top])
