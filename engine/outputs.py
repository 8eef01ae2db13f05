"""What the engine hands back per step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.sampling import Logprob
from splitserve.common.worker_messages import RetryReason


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in this worker's prefix cache
    num_loaded_tokens: int = 0  # prompt tokens loaded from the KV pool
    num_output_tokens: int = 0
    error: str | None = None
    retry: RetryReason | None = None  # with finish_reason error: another worker may go on with it, and why
