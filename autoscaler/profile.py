"""A replica's measured profile: the cost of one engine step, fitted to our engine's step times, and what one
replica can carry at the SLO (prefill tokens/s within the TTFT objective, decode tokens/s within the ITL one).

The control law sizes pools from `capacity_at_slo`; the simulator times every step with `StepCost`. Both read
the same JSON file (`autoscaler/profiles/*.json`, shipped in the package), written by the calibration command. Plain
Python: no torch, no numpy.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 2  # 2: a cold start per engine and the flip time (1 had one model_load_seconds, read as native's)
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"  # the committed profiles, shipped in the package


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine step from what is in it (fitted; see docs/autoscaling.md).

    step = base + per_seq·S + per_token·max(N, knee) + per_ctx_token·C + per_attn_pair·A, where S is the number
    of sequences in the step, N the tokens computed, C the KV tokens read by the decoding sequences and A the
    (query, key) pairs of the prefill chunks' attention. Below `knee_tokens` a step is bound by reading the
    weights; above, by the matmuls.
    """

    base_s: float  # s: launch, sampling, scheduling
    per_seq_s: float  # s per sequence in the step
    per_token_s: float  # s per token computed, once compute-bound
    knee_tokens: float  # tokens: below this the weight read dominates (weights_s = per_token_s * knee_tokens)
    per_ctx_token_s: float  # s per KV token a decoding sequence reads
    per_attn_pair_s: float  # s per (query token, key token) pair of prefill attention

    def seconds(self, num_seqs: int, num_tokens: int, ctx_tokens: int = 0, attn_pairs: float = 0.0) -> float:
        return (self.base_s + self.per_seq_s * num_seqs + self.per_token_s * max(num_tokens, self.knee_tokens)
                + self.per_ctx_token_s * ctx_tokens + self.per_attn_pair_s * attn_pairs)

    def decode_seconds(self, batch: int, ctx_tokens: int) -> float:
        """One decode step of `batch` sequences holding `ctx_tokens` KV tokens in all."""
        return self.seconds(batch, batch, ctx_tokens)


def attn_pairs(num_new: int, num_past: int) -> float:
    """(query, key) pairs of a prefill chunk of `num_new` tokens after `num_past` computed ones (causal)."""
    return num_new * (num_past + (num_new + 1) / 2)


@dataclass(frozen=True)
class ReplicaProfile:
    """One replica (one worker, `tensor_parallel_size` GPUs) of one model on one kind of machine."""

    name: str  # e.g. llama8b-h200, smollm2-cpu2
    cost: StepCost
    kv_capacity_tokens: int  # tokens of KV cache on one replica
    kv_bytes_per_token: int  # bytes moved per prompt token from prefill to decode
    max_num_seqs: int = 128  # the engine's batch limit
    max_num_batched_tokens: int = 2048  # the engine's token budget per step
    kv_transfer_gbps: float = 10.0  # GB/s of layer-wise KV streaming between two workers
    kv_transfer_tail_s: float = 0.005  # s from the last layer written to all KV landed
    # s from asking for a worker to its first request (start, weights, warm-up), per engine (native, vllm)
    cold_start_seconds: dict[str, float] = field(default_factory=lambda: {"native": 60.0})
    flip_seconds: float = 5.0  # s a drained worker takes to serve the other role (re-register, gateways follow)
    source: dict[str, Any] = field(default_factory=dict)  # provenance: files, fit residuals, measured points

    # -- single requests -----------------------------------------------------------------------------------
    def prefill_seconds(self, num_tokens: int, num_cached: int = 0) -> float:
        """A prompt alone on a replica, chunked by the token budget (s)."""
        t, done, budget = 0.0, num_cached, self.max_num_batched_tokens
        while done < num_tokens:
            n = min(budget, num_tokens - done)
            t += self.cost.seconds(1, n, 0, attn_pairs(n, done))
            done += n
        return t

    def prefill_tokens_per_s(self, mean_prompt: float) -> float:
        """Prompt tokens/s of a busy prefill replica: full-budget steps, attention at the mean prompt's length."""
        budget = self.max_num_batched_tokens
        mean_prompt = max(1.0, mean_prompt)
        per_step = min(budget, mean_prompt)  # a step carries whole short prompts or one chunk of a long one
        seqs = max(1, math.floor(budget / per_step))
        n = seqs * per_step
        past = max(0.0, mean_prompt - per_step) / 2  # mean past of a long prompt's chunks
        t = self.cost.seconds(seqs, int(n), 0, seqs * attn_pairs(int(per_step), int(past)))
        return n / t

    def kv_transfer_seconds(self, num_tokens: int) -> float:
        """Whole-request KV transfer time at the measured layer-wise bandwidth (s)."""
        return num_tokens * self.kv_bytes_per_token / (self.kv_transfer_gbps * 1e9)

    def cold_start(self, engine: str) -> float:
        """s from asking for a worker of this engine to its first request, as measured; an engine not measured
        on this machine gets the longest start that was (a cold start planned too short buys replicas late)."""
        if engine in self.cold_start_seconds:
            return self.cold_start_seconds[engine]
        return max(self.cold_start_seconds.values())

    # -- files ---------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplicaProfile:
        data = dict(data)
        version = data.pop("version", None)
        if version == 1:  # one start time, measured on the native engine; no flip measured yet (the default)
            data["cold_start_seconds"] = {"native": data.pop("model_load_seconds", 60.0)}
        elif version != PROFILE_VERSION:
            raise ValueError(f"profile version {version!r}: this splitserve reads versions 1 and {PROFILE_VERSION}")
        data["cost"] = StepCost(**data["cost"])
        starts = data.get("cold_start_seconds")
        if starts is not None and (not isinstance(starts, dict) or not starts or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                for v in starts.values())):
            raise ValueError(f"cold_start_seconds: {starts!r} is not a map of engine to seconds > 0")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ReplicaProfile:
        return cls.from_json(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class ReplicaCapacity:
    """What one replica carries while meeting the SLO, for the current request mix."""

    prefill_tokens_per_s: float  # prompt tokens/s at the utilisation the TTFT objective allows
    prefill_raw_tokens_per_s: float  # prompt tokens/s flat out (how fast a queue drains)
    prefill_utilization: float  # the fraction of flat-out the TTFT objective allows (queueing headroom)
    decode_batch: int  # sequences in a decode step within the ITL objective, the KV cache and max_num_seqs
    decode_step_s: float  # s per decode step at that batch
    decode_tokens_per_s: float  # output tokens/s at that batch


TTFT_TAIL = 2.3  # p90 of an exponential wait is ln(10) = 2.3 times its mean
ITL_HEADROOM = 0.8  # decode steps are sized to 80% of the ITL objective: mixed steps and a per-request p99
KV_HEADROOM = 0.9  # KV fraction a full decode batch may hold (growth past the mean, preemption margin)


def decode_context(mean_input: float, mean_output: float) -> float:
    """Mean KV tokens of a decoding sequence over its life (its prompt and half its output)."""
    return mean_input + mean_output / 2


def kv_sequences(profile: ReplicaProfile, mean_input: float, mean_output: float) -> int:
    """Sequences of these mean lengths one replica's KV cache holds, at KV_HEADROOM of it."""
    return int(KV_HEADROOM * profile.kv_capacity_tokens / max(1.0, decode_context(mean_input, mean_output)))


def capacity_at_slo(profile: ReplicaProfile, ttft_s: float, itl_s: float, mean_input: float, mean_output: float,
                    max_utilization: float = 0.9) -> ReplicaCapacity:
    """A replica's capacity at the SLO for requests of these mean lengths (tokens).

    Prefill: a replica is an M/G/1 queue with service time s = the mean prompt's prefill time; the p90 wait
    ~ TTFT_TAIL·s·ρ/(1-ρ) must fit in the TTFT objective with s itself, which bounds the utilisation ρ.
    Decode: the largest batch whose step fits ITL_HEADROOM of the ITL objective, whose mean KV fits the cache
    and which the engine allows; tokens/s = batch / step.
    """
    raw = profile.prefill_tokens_per_s(mean_input)
    s = profile.prefill_seconds(max(1, round(mean_input))) + profile.kv_transfer_tail_s
    slack = ttft_s - s
    rho = 0.0 if slack <= 0 else min(max_utilization, (slack / (TTFT_TAIL * s)) / (1 + slack / (TTFT_TAIL * s)))
    rho = max(rho, 0.05)  # prompts too long for the objective still need replicas: size them at 5%
    ctx = decode_context(mean_input, mean_output)
    hi = max(1, min(profile.max_num_seqs, kv_sequences(profile, mean_input, mean_output)))
    batch = 1
    lo_b, hi_b = 1, hi
    while lo_b <= hi_b:  # the step time grows with the batch: bisect for the largest one in the objective
        mid = (lo_b + hi_b) // 2
        if profile.cost.decode_seconds(mid, int(mid * ctx)) <= ITL_HEADROOM * itl_s:
            batch, lo_b = mid, mid + 1
        else:
            hi_b = mid - 1
    step = profile.cost.decode_seconds(batch, int(batch * ctx))
    return ReplicaCapacity(prefill_tokens_per_s=raw * rho, prefill_raw_tokens_per_s=raw, prefill_utilization=rho,
                           decode_batch=batch, decode_step_s=step, decode_tokens_per_s=batch / step)
