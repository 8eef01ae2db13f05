"""Per-request sampling parameters (validated on construction), the log-probabilities a step returns, and the
uniform number each sampled output position draws: a pure function of (seed, output position), so a seeded
request gives the same tokens wherever its positions are sampled (colocated, prefill then decode, resumed)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field

MAX_SEED = (1 << 63) - 1


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; 0: chosen token only; n: chosen + top-n
    include_stop_str_in_output: bool = False
    # Output tokens produced before this request started (a resumed request): its first sampled token is output
    # position `output_offset`, so it draws what an uninterrupted run drew there.
    output_offset: int = 0

    MAX_LOGPROBS = 20
    MIN_TEMPERATURE = 1e-5
    MAX_OUTPUT_OFFSET = (1 << 32) - 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be a non-negative 63-bit integer, got {self.seed!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if len(self.stop) > 16:
            raise ValueError("stop takes at most 16 strings")
        if not isinstance(self.output_offset, int) or not 0 <= self.output_offset <= self.MAX_OUTPUT_OFFSET:
            raise ValueError(f"output_offset must be in [0, {self.MAX_OUTPUT_OFFSET}], got {self.output_offset!r}")

    @property
    def greedy(self) -> bool:
        # below MIN_TEMPERATURE, logits / temperature overflows float32: the same as greedy anyway
        return self.temperature < self.MIN_TEMPERATURE or self.top_k == 1


def random_seed() -> int:
    """A seed for a sampled request that came without one (the gateway gives it one, so it can move)."""
    return secrets.randbits(63)


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that output position `position` of a request seeded `seed` samples with (inverse
    CDF): a keyed hash, so any process draws it for any position without a generator's history."""
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=8,
                             person=b"splitserve-draw").digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / (1 << 53))  # 53 random bits: exact in a float64
