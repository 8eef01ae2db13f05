"""What the control law sees, read off a live cluster: membership from the Redis registry (replicas ready and
draining per role, each worker's load report) and the gateways' and workers' Prometheus `/metrics` (request
and token counters, TTFT/ITL histograms), differenced between two calls into one `Observation` over the window.

Everything read off the wire is validated: a registry entry, a scrape or a sample that does not validate is
counted (`splitserve_autoscaler_observe_errors_total{source}`) and skipped, never raised. No torch; the
operator and `splitserve up --autoscale` both call `Observer.observe`.

Where the numbers come from (the workers report no busy time or queue-wait histogram yet, so those stay 0/empty):
- replicas: registry entries (not draining: ready; draining: draining); starting = what the actuator asked for
  (`expected`) less those ready;
- now: each ready worker's registry load (waiting, running, waiting prefill tokens, KV blocks used / capacity);
- rates over the window: the gateways' `splitserve_requests_total` (answered requests), prompt and generated
  token counters; prefill workers' `splitserve_worker_requests_total{rpc="prefill"}`; the decode workers'
  `splitserve_remote_prefill_total` / `splitserve_local_prefill_total` split the prompt tokens between pools;
- latency: the gateways' TTFT and ITL histograms, the window's bucket deltas interpolated as PromQL's
  `histogram_quantile` does.
"""

from __future__ import annotations

import logging
import math
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from splitserve.autoscaler.observations import Observation, Percentiles, RoleObservation
from splitserve.common.redis_wire import READ_LEASES_SCRIPT, Keys, RegistryEntry, WireError

log = logging.getLogger("splitserve.autoscaler.observer")
OBSERVE_ERRORS = Counter("splitserve_autoscaler_observe_errors",
                         "Registry reads, entries, scrapes or samples the autoscaler skipped as invalid or missing",
                         ["source"])
MAX_SCRAPE_BYTES = 4 << 20  # a /metrics page larger than this is not ours
Sample = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted labels)
Fetch = Callable[[str, float], str]  # (url, timeout s) -> body text; raises OSError


def http_get(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (URLs from config and the registry)
        body = r.read(MAX_SCRAPE_BYTES + 1)
    if len(body) > MAX_SCRAPE_BYTES:
        raise OSError(f"{url}: more than {MAX_SCRAPE_BYTES} bytes")
    return body.decode("utf-8")


def parse_metrics(text: str) -> dict[Sample, float]:
    """Prometheus text → {(sample name, labels): value}; raises ValueError on text that does not parse or on
    a value that is not a finite number ≥ 0 (every splitserve_ counter, gauge and bucket is)."""
    out: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("splitserve_"):
                continue
            v = float(s.value)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{s.name}: value {s.value!r}")
            out[(s.name, tuple(sorted(s.labels.items())))] = v
    return out


def total(samples: Mapping[Sample, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """PromQL's histogram_quantile over cumulative (le, count) buckets (+Inf last): linear within a bucket, the
    highest finite bound when the quantile falls in +Inf. None with no samples."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return buckets[-1][0]


def _percentiles(delta: Mapping[Sample, float], name: str) -> Percentiles:
    by_le: dict[float, float] = {}
    for (n, labels), v in delta.items():
        if n != f"{name}_bucket":
            continue
        le = dict(labels).get("le")
        try:
            bound = float(le) if le is not None else math.nan
        except ValueError:
            continue
        if not math.isnan(bound):
            by_le[bound] = by_le.get(bound, 0.0) + v
    buckets = sorted(by_le.items())
    if not buckets or buckets[-1][1] < 1:
        return Percentiles()
    return Percentiles(histogram_quantile(0.5, buckets), histogram_quantile(0.9, buckets),
                       histogram_quantile(0.99, buckets), int(buckets[-1][1]))


def _delta(now: Mapping[Sample, float], before: Mapping[Sample, float] | None) -> dict[Sample, float]:
    """Counter increase since the last scrape of the same process (a value that went down: the process
    restarted, and counts from 0). A source seen for the first time contributes nothing: its whole history is
    not this window's."""
    if before is None:
        return {}
    return {k: (v - before[k] if k in before and v >= before[k] else v) for k, v in now.items()}


def _add(into: dict[Sample, float], more: Mapping[Sample, float]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0.0) + v


@dataclass
class _Sources:
    """The last scrape of each source (gateway URL, or worker name + instance), for the next window's deltas."""

    last: dict[str, dict[Sample, float]] = field(default_factory=dict)

    def delta(self, key: str, samples: dict[Sample, float]) -> dict[Sample, float]:
        d = _delta(samples, self.last.get(key))
        self.last[key] = samples
        return d


class Observer:
    """Builds one `Observation` per call from the registry in Redis and the `/metrics` of the gateways and of
    every worker the registry lists. `gateways` is a list of base URLs, or a callable returning it."""

    def __init__(self, redis_url: str | None, model: str, gateways: Sequence[str] | Callable[[], Sequence[str]],
                 *, fetch: Fetch = http_get, timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 colocated: bool = False) -> None:
        self.keys = Keys(model)
        self.model = model
        self.redis_url = redis_url
        self._redis = None
        self.gateways = gateways
        self.fetch = fetch
        self.timeout_s = timeout_s
        self.clock = clock
        self.colocated = colocated
        self.errors: dict[str, int] = {}  # source -> skipped reads (also the Prometheus counter)
        self.entries: dict[str, RegistryEntry] = {}  # the registry as last read
        self._sources = _Sources()
        self._last_time: float | None = None

    # -- reading ------------------------------------------------------------------------------------------
    def _error(self, source: str, message: str) -> None:
        self.errors[source] = self.errors.get(source, 0) + 1
        OBSERVE_ERRORS.labels(source).inc()
        log.warning("autoscaler observation: skipped %s: %s", source, message[:300])

    def registry(self) -> dict[str, RegistryEntry] | None:
        """The live registry entries by name; None when Redis did not answer (or there is none)."""
        if self.redis_url is None:
            return None
        import redis

        try:
            if self._redis is None:
                self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=self.timeout_s,
                                                   socket_connect_timeout=self.timeout_s)
            now, flat = self._redis.eval(READ_LEASES_SCRIPT, 1, self.keys.workers)
            names = [(m.decode() if isinstance(m, bytes) else str(m)) for m, score in zip(flat[::2], flat[1::2],
                                                                                              strict=True)
                     if float(score) > int(now)]
            raws = self._redis.mget([self.keys.worker(n) for n in names]) if names else []
        except (redis.RedisError, OSError, ValueError, TypeError) as e:
            self._error("redis", str(e))
            return None
        entries: dict[str, RegistryEntry] = {}
        for name, raw in zip(names, raws, strict=True):
            if raw is None:
                continue  # expired between the two reads
            try:
                entry = RegistryEntry.decode(raw)
            except WireError as e:
                self._error("registry_entry", f"{name[:64]!r}: {e}")
                continue
            if entry.name != name or entry.model not in ("", self.model):
                self._error("registry_entry", f"{name[:64]!r}: name or model does not match its key")
                continue
            entries[name] = entry
        return entries

    def scrape(self, source: str, url: str) -> dict[Sample, float] | None:
        """`url`'s /metrics parsed and validated; None (counted) when it cannot be read or does not parse."""
        try:
            return parse_metrics(self.fetch(url.rstrip("/") + "/metrics", self.timeout_s))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            self._error(source, f"{url}: {e}")
            return None

    # -- the observation ----------------------------------------------------------------------------------
    def observe(self, expected: Mapping[str, int] | None = None) -> Observation:
        """One observation over the time since the last call (the first call's rates and latencies are empty).
        `expected`: replicas the actuator has asked for per role (the rest of them, not yet in the registry as
        ready, count as starting)."""
        now = self.clock()
        window = max(1e-3, now - self._last_time) if self._last_time is not None else 0.0
        self._last_time = now
        entries = self.registry()
        if entries is not None:
            self.entries = entries
        gateway = self._gateway_delta()
        workers: dict[str, dict[Sample, float]] = {"prefill": {}, "decode": {}}
        for e in self.entries.values():
            if not e.metrics_url:
                continue
            samples = self.scrape("worker_metrics", e.metrics_url)
            if samples is not None:
                _add(workers[_pool(e.role)], self._sources.delta(f"{e.name}/{e.instance_id}", samples))
        live = {f"{e.name}/{e.instance_id}" for e in self.entries.values()} | {f"gateway:{u}" for u in self._urls()}
        self._sources.last = {k: v for k, v in self._sources.last.items() if k in live}
        expected = expected or {}
        return Observation(now, window, self._role("prefill", window, gateway, workers, expected),
                           self._role("decode", window, gateway, workers, expected))

    def _urls(self) -> list[str]:
        return list(self.gateways() if callable(self.gateways) else self.gateways)

    def _gateway_delta(self) -> dict[Sample, float]:
        out: dict[Sample, float] = {}
        for url in self._urls():
            samples = self.scrape("gateway_metrics", url)
            if samples is not None:
                _add(out, self._sources.delta(f"gateway:{url}", samples))
        return out

    def _role(self, role: str, window: float, gw: Mapping[Sample, float], workers: Mapping[str, dict[Sample, float]],
              expected: Mapping[str, int]) -> RoleObservation:
        mine = [e for e in self.entries.values() if _pool(e.role) == role]
        ready = [e for e in mine if not e.draining]
        draining = len(mine) - len(ready)
        starting = max(0, expected.get(role, len(ready)) - len(ready))
        kv = [e.kv_blocks_used / e.kv_capacity_blocks for e in ready if e.kv_capacity_blocks > 0]
        rate = (lambda x: x / window) if window > 0 else (lambda x: 0.0)
        answered = total(gw, "splitserve_requests_total", status="200")
        prompt = total(gw, "splitserve_prompt_tokens_total")
        generated = total(gw, "splitserve_generation_tokens_total")
        mean_in = prompt / answered if answered else 0.0
        mean_out = generated / answered if answered else 0.0
        # decode workers say which prompts went to a prefill worker and which they computed themselves
        remote = total(workers["decode"], "splitserve_remote_prefill_total", outcome="ok")
        local = total(workers["decode"], "splitserve_local_prefill_total")
        remote_share = (remote / (remote + local) if remote + local else 1.0) if not self.colocated else 0.0
        common = dict(role=role, replicas_ready=len(ready), replicas_starting=starting, replicas_draining=draining,
                      idle_replicas=sum(1 for e in ready if e.num_running == 0 and e.num_waiting == 0),
                      num_waiting=sum(e.num_waiting for e in ready), num_running=sum(e.num_running for e in ready),
                      waiting_prefill_tokens=sum(e.waiting_prefill_tokens for e in ready),
                      kv_usage=sum(kv) / len(kv) if kv else 0.0)
        if role == "prefill":
            served = total(workers["prefill"], "splitserve_worker_requests_total", rpc="prefill", status="ok")
            return RoleObservation(**common, arrival_rate=rate(served), input_tokens_per_s=rate(prompt * remote_share),
                                   mean_input_tokens=mean_in, ttft=_percentiles(gw, "splitserve_time_to_first_token_seconds"))
        return RoleObservation(**common, arrival_rate=rate(answered), input_tokens_per_s=rate(prompt * (1 - remote_share)),
                               output_tokens_per_s=rate(generated), mean_input_tokens=mean_in,
                               mean_output_tokens=mean_out, ttft=_percentiles(gw, "splitserve_time_to_first_token_seconds"),
                               itl=_percentiles(gw, "splitserve_inter_token_latency_seconds"))

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
            self._redis = None


def _pool(worker_role: str) -> str:
    """The pool a worker counts in: prefill, or decode (colocated workers decode)."""
    return "prefill" if worker_role == "prefill" else "decode"
