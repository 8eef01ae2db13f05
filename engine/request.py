"""Request state: one class, one status enum (a status for each external wait)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitserve.common.sampling import Logprob, SamplingParams

# An output token still being sampled on the device: the overlapped decode step (`LLMEngine.step`) appends it at
# launch and replaces it when the step's tokens reach the host. Only ever the last entries of `output_token_ids`.
PENDING_TOKEN = -1


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1  # decode side: blocks reserved, prompt KV arriving from a prefill worker
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 10  # EOS, stop token or stop string
    FINISHED_LENGTH = 11  # max_tokens or context length
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first under the priority policy
    arrival_time: float = field(default_factory=time.monotonic)
    # Prefill role: keep the blocks after finishing until `release` (the KV transfer reads them).
    hold_blocks: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first schedule
    num_loaded_tokens: int = 0  # prompt tokens whose KV was loaded from outside (the KV pool)
    num_preemptions: int = 0
    num_pending: int = 0  # trailing PENDING_TOKEN entries of output_token_ids
    stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
