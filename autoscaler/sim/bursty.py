"""A generated bursty, prefill-heavy trace: the load the shared traces lack (batch jobs and agent fan-outs that
send many long prompts at once on top of a steady, slowly varying stream of chat-like requests).

Two processes, deterministic by seed (`random.Random(seed)`, no other source of randomness):
- the **base stream**: Poisson arrivals whose rate varies sinusoidally (±`base_swing` over `period_s`: the
  periodicity a forecast could use), prompts log-normal around `base_prompt` tokens, outputs around
  `output_tokens` (short: the requests are prefill-heavy);
- **bursts**: their starts are a Poisson process (one every `burst_every_s` on average); each lasts a uniform
  `burst_s` range and adds `burst_factor` x the base rate (uniform in its range) of requests whose prompts are
  log-normal around `burst_prompt` tokens (documents, retrieved context), with the same short outputs.

Rows are `TraceRow`s (arrival s from 0, prompt and output tokens), so `trace.scale` replays them at any rate
scale as it replays the shared traces. Nothing here is fitted to a trace file: the defaults are round numbers
chosen so that the bursts are shorter than or comparable to a cold start and carry several times the base load.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from splitserve.autoscaler.sim.trace import TraceRow


@dataclass(frozen=True)
class BurstyConfig:
    duration_s: float = 3600.0  # trace seconds
    base_rate: float = 1.0  # requests/s of the base stream (mean over a period)
    base_swing: float = 0.3  # the base rate moves within (1 ± this) x base_rate over a period
    period_s: float = 1200.0  # s, the base rate's period
    base_prompt: int = 1500  # tokens, median prompt of the base stream
    burst_prompt: int = 4000  # tokens, median prompt of a burst
    prompt_sigma: float = 0.8  # log-normal sigma of prompt lengths
    output_tokens: int = 120  # median output tokens (both streams)
    output_sigma: float = 0.7
    burst_every_s: float = 300.0  # s, mean gap between burst starts
    burst_s: tuple[float, float] = (20.0, 120.0)  # s, a burst's duration (uniform)
    burst_factor: tuple[float, float] = (1.5, 4.0)  # a burst adds this x base_rate (uniform)
    max_prompt: int = 32768
    max_output: int = 2048

    def __post_init__(self) -> None:
        for name in ("duration_s", "base_rate", "period_s", "burst_every_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not 0 <= self.base_swing < 1:
            raise ValueError("base_swing must be in [0, 1)")
        if not (0 < self.burst_s[0] <= self.burst_s[1] and 0 <= self.burst_factor[0] <= self.burst_factor[1]):
            raise ValueError("burst_s and burst_factor must be (low, high) ranges, low <= high")


@dataclass(frozen=True)
class Burst:
    start: float  # s
    length: float  # s
    rate: float  # requests/s added


def bursts(cfg: BurstyConfig, rng: random.Random) -> list[Burst]:
    out, t = [], rng.expovariate(1 / cfg.burst_every_s)
    while t < cfg.duration_s:
        out.append(Burst(t, rng.uniform(*cfg.burst_s), rng.uniform(*cfg.burst_factor) * cfg.base_rate))
        t += rng.expovariate(1 / cfg.burst_every_s)
    return out


def generate(cfg: BurstyConfig = BurstyConfig(), seed: int = 0) -> tuple[list[TraceRow], list[Burst]]:
    """The trace's rows (sorted by arrival) and the bursts it holds (for tests and plots)."""
    rows, found, _ = generate_tagged(cfg, seed)
    return rows, found


def generate_tagged(cfg: BurstyConfig = BurstyConfig(), seed: int = 0) -> tuple[list[TraceRow], list[Burst], list[int]]:
    """`generate`'s rows and bursts, and for each row the index of the burst it belongs to (-1: the base stream),
    for references that know which requests a burst brought."""
    rng = random.Random(seed)
    found = bursts(cfg, rng)

    def length(median: int, sigma: float, top: int) -> int:
        return max(1, min(top, round(rng.lognormvariate(math.log(median), sigma))))

    rows: list[tuple[float, int, int, int]] = []
    top_rate = cfg.base_rate * (1 + cfg.base_swing)
    t = 0.0
    while True:  # the base stream: a Poisson process thinned to its sinusoidal rate
        t += rng.expovariate(top_rate)
        if t >= cfg.duration_s:
            break
        rate = cfg.base_rate * (1 + cfg.base_swing * math.sin(2 * math.pi * t / cfg.period_s))
        if rng.random() * top_rate < rate:
            rows.append((t, length(cfg.base_prompt, cfg.prompt_sigma, cfg.max_prompt),
                         length(cfg.output_tokens, cfg.output_sigma, cfg.max_output), -1))
    for i, b in enumerate(found):
        t = b.start
        while True:
            t += rng.expovariate(b.rate) if b.rate > 0 else math.inf
            if t >= min(b.start + b.length, cfg.duration_s):
                break
            rows.append((t, length(cfg.burst_prompt, cfg.prompt_sigma, cfg.max_prompt),
                         length(cfg.output_tokens, cfg.output_sigma, cfg.max_output), i))
    rows.sort()
    return [TraceRow(a, p, o) for a, p, o, _ in rows], found, [tag for *_, tag in rows]
