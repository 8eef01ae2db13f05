"""Between protobuf messages and our own types, validating every field on receipt."""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.common.protocol import PROTOCOL_VERSION
from splitserve.common.protocol import splitserve_pb2 as pb
from splitserve.common.sampling import Logprob, SamplingParams

MAX_REQUEST_ID = 256
MAX_PROMPT_TOKENS = 1 << 20


class ProtocolError(ValueError):
    """A message that fails validation; the message names the field."""


def check_request(protocol_version: int, request_id: str, prompt: Sequence[int], vocab_size: int,
                  max_model_len: int) -> None:
    if protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol_version {protocol_version} is not supported (this worker speaks {PROTOCOL_VERSION})")
    if not request_id or len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
        raise ProtocolError("request_id: 1-256 printable characters")
    if not prompt:
        raise ProtocolError("prompt_token_ids: empty")
    if len(prompt) > MAX_PROMPT_TOKENS or len(prompt) >= max_model_len:
        raise ProtocolError(f"prompt_token_ids: {len(prompt)} tokens, context length is {max_model_len}")
    if max(prompt) >= vocab_size:
        raise ProtocolError(f"prompt_token_ids: ids must be below the vocabulary size {vocab_size}")


def check_resume(prompt: Sequence[int], resume: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """The output tokens a moved request already produced: they follow the prompt in its context."""
    if not resume:
        return
    if len(prompt) + len(resume) >= max_model_len:
        raise ProtocolError(f"resume_token_ids: {len(prompt)} + {len(resume)} tokens, context length is {max_model_len}")
    if max(resume) >= vocab_size:
        raise ProtocolError(f"resume_token_ids: ids must be below the vocabulary size {vocab_size}")


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        has_seed=p.seed is not None, seed=p.seed or 0, stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos, want_logprobs=p.logprobs is not None, top_logprobs=p.logprobs or 0,
        min_tokens=p.min_tokens, include_stop_str_in_output=p.include_stop_str_in_output,
        output_offset=p.output_offset,
    )


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
        raise ProtocolError(f"params: {e}") from None


def logprob_to_pb(lp: Logprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_pb(m: pb.TokenLogprob) -> Logprob:
    return Logprob(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top])
