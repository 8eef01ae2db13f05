"""The one configuration model: a typed spec per component, composed into `ClusterSpec`, inside a
Kubernetes-shaped document (`apiVersion`, `kind`, `metadata`, `spec`).

The file a user runs with `splitserve up -f` is the file they `kubectl apply` later. Each field's docstring is
its CLI help, its JSON Schema description (and so the CRD's and the Helm chart's documentation); keys are
camelCase in files and snake_case in Python. Values measured at run time (KV blocks, ports picked by the local
launcher) are not here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from splitserve.common import engines
from splitserve.common.engines import DEFAULT_ENGINE, EngineKind

API_VERSION = "splitserve.dev/v1alpha1"
KIND = "SplitServeCluster"

_MEMORY_RE = re.compile(r"^\s*(auto|\d+(\.\d+)?\s*([KMGT]i?B?|B)?|0?\.\d+|1(\.0*)?)\s*$", re.IGNORECASE)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_memory(value: str | int | float, field_name: str = "kv_cache_memory") -> int | float:
    """Parse '512MiB', '2G', 1073741824 (bytes) or a fraction in (0, 1] of free memory.

    Returns an int (bytes) or a float fraction.
    """
    if isinstance(value, bool):
        raise ValueError(f"{field_name}: expected bytes or a fraction, got {value!r}")
    if isinstance(value, float) or (isinstance(value, str) and re.fullmatch(r"\s*0?\.\d+\s*|\s*1\.0*\s*", value)):
        frac = float(value)
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"{field_name}: a fraction must be in (0, 1], got {value!r}")
        return frac
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{field_name}: must be positive, got {value!r}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"{field_name}: cannot parse {value!r} (use e.g. 512MiB, 2GiB, 0.9)")
    unit = (m.group(2) or "").upper().rstrip("B")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{field_name}: must be positive, got {value!r}")
    return n


class Spec(BaseModel):
    """Base of every config section: unknown keys are errors, camelCase keys in files."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True,
                              use_attribute_docstrings=True, validate_assignment=True)


# Marks a field whose default depends on the engine: its schemas carry no default, so a stored resource leaves
# it unset and the engine's applies (the API server would otherwise fill in the native engine's).
ENGINE_DEFAULT = "x-splitserve-engine-default"

Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[float, Field(gt=0)]
Count = Annotated[int, Field(ge=0)]


class ModelSpec(Spec):
    name: str = "smollm2"
    """The model: `smollm2` (embedded), a Hugging Face model directory, or a .gguf file."""
    served_model_name: str | None = None
    """The name clients put in `model` (default: the model's name)."""
    tokenizer: str | None = None
    """Where the tokenizer files are, when the model directory has none (dummy weights)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and KV cache dtype; auto is float32 on CPU, and on CUDA bfloat16 (engine vllm: the model's own
    dtype, vLLM's rule)."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """auto, cpu, cuda or cuda:N."""
    max_model_len: Annotated[int, Field(ge=16)] | None = None
    """Context length in tokens (default: the model's)."""
    load_format: Literal["auto", "dummy"] = "auto"
    """auto loads the checkpoint; dummy gives random weights of the model's shape (benchmarks)."""
    block_size: Literal[1, 2, 4, 8, 16, 32, 64, 128, 256] = Field(16, json_schema_extra={ENGINE_DEFAULT: True})
    """Tokens per KV block (the unit of caching, hashing and transfer); unset: 16 with engine native, 32 with
    engine vllm."""
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    """GPUs sharing each layer, one process each."""
    expert_parallel: bool = False
    """MoE: spread whole experts over the tensor-parallel GPUs."""
    enforce_eager: bool = False
    """CUDA: run decode steps eagerly (no CUDA graphs)."""

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.name



# vLLM flags splitserve sets itself from the model (`vllm_engine.server.command`): in `vllmArgs` they are refused.
VLLM_OWNED_FLAGS = frozenset({
    "--model", "--served-model-name", "--tokenizer", "--host", "--port", "--dtype", "--max-model-len",
    "--block-size", "--tensor-parallel-size", "-tp", "--data-parallel-size", "-dp", "--enable-expert-parallel",
    "--enforce-eager",
    "--load-format", "--max-num-seqs", "--max-num-batched-tokens", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--scheduling-policy", "--seed", "--kv-transfer-config", "--kv-events-config",
    "--kv-cache-memory-bytes", "--kv-cache-memory", "--api-key", "--long-prefill-token-threshold",
})


def check_vllm_args(args: list[str]) -> list[str]:
    """Extra vLLM server arguments: plain words, no flag splitserve sets itself."""
    if len(args) > 128:
        raise ValueError(f"{len(args)} arguments; at most 128")
    for arg in args:
        if not arg or len(arg) > 4096 or any(c in arg for c in "\x00\n\r"):
            raise ValueError(f"{arg[:40]!r} is not a plain argument (empty, too long, or a control character)")
        name = arg.split("=", 1)[0]
        if name in VLLM_OWNED_FLAGS:
            raise ValueError(f"{name} is set by splitserve from the cluster's own fields (model, engine, ports); "
                             f"set it there")
    return args


class EngineSpec(Spec):
    kind: EngineKind | None = None
    """This role's engine: native or vllm (default: the cluster's `engine`)."""
    vllm_args: list[str] = Field(default_factory=list)
    """Extra arguments for this role's vLLM servers (engine vllm), after the cluster's `vllm.args`, e.g.
    [--quantization, fp8]; flags splitserve sets from the model are refused."""
    kv_cache_memory: str = "auto"
    """KV cache size: bytes (512MiB, 2GiB), a fraction of free memory (0.9), or auto."""
    max_num_seqs: Annotated[int, Field(ge=1)] = 128
    """Requests in one batch at most."""
    max_num_batched_tokens: Annotated[int, Field(ge=1)] = 2048
    """Tokens in one step at most (chunked prefill splits longer prompts)."""
    long_prefill_token_threshold: Count = 0
    """Engine native: a prompt's chunk in one step at most, in tokens (vLLM's name); 0: maxNumBatchedTokens."""
    max_prefill_tokens_while_decoding: Count = 0
    """Engine native: prompt tokens in one step at most while the step also decodes (0: maxNumBatchedTokens).
    Decodes go first in every step and prompt chunks take what is left; this cap bounds the step's time, which
    is every decoding stream's inter-token latency: about (slo.itlSeconds - a decode step's time) x the
    worker's prefill tokens/s (e.g. 1024 for an 8B model on an H200 with a 50 ms objective)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of prompt prefixes already computed on this worker."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """fcfs, or priority (the request's `priority`, lower first)."""
    threads: Count = 0
    """CPU threads for the model's math (0: under `splitserve up` and `serve-ray` on a CPU, the cores this process
    may use (its affinity) shared among the workers; elsewhere the library's default)."""
    seed: int = 0
    """Seed of requests sampled without their own seed."""
    batch_invariant: bool = False
    """Compute each token the same whatever else is in its engine step and wherever its prompt was computed: a
    seeded or greedy request then gives the same tokens colocated or disaggregated, after a prefix-cache hit, a
    KV pool load or a move, alone or in a batch (same hardware, dtype and settings). Native engine: attention
    over fixed KV tiles, a lone matmul row computed as two (docs/engines.md gives the cost). Engine vllm:
    vLLM's VLLM_BATCH_INVARIANT, on a GPU only."""
    data_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    """engine vllm: data-parallel ranks in each worker's vLLM server, each with model.tensorParallelSize GPUs
    (MoE with model.expertParallel: attention data-parallel, experts spread over every GPU). Native: 1 (more
    engines are more replicas)."""

    @field_validator("vllm_args")
    @classmethod
    def _vllm_args(cls, v: list[str]) -> list[str]:
        return check_vllm_args(v)

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _memory(cls, v: Any) -> str:
        text = str(v)
        if not _MEMORY_RE.match(text):
            raise ValueError(f"{v!r} is not a size (512MiB, 2GiB), a fraction (0.9) or auto")
        return text


class RoleSpec(Spec):
    replicas: Count = 1
    """Workers of this role (the autoscaler moves this within minReplicas..maxReplicas)."""
    min_replicas: Count = 0
    """Fewest workers the autoscaler may leave."""
    max_replicas: Count = 8
    """Most workers the autoscaler may start."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    """The engine's settings on this role's workers."""
    port: Port = 50051
    """gRPC port of each worker."""
    metrics_port: Port = 9100
    """HTTP port of each worker: /metrics, /healthz, /readyz, /stats."""
    drain_seconds: Seconds = 120.0
    """On SIGTERM (scale-down), how long a worker may finish its requests in flight before it exits."""
    resources: dict[str, dict[str, int | str]] = Field(default_factory=dict)
    """Kubernetes: the worker container's resource requests and limits (e.g. nvidia.com/gpu)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Kubernetes: node labels this role's pods must run on (e.g. a GPU kind)."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Kubernetes: tolerations of this role's pods."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """Kubernetes: affinity of this role's pods."""

    @model_validator(mode="after")
    def _bounds(self) -> RoleSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas: {self.min_replicas} is above maxReplicas ({self.max_replicas})")
        return self


class PrefillSpec(RoleSpec):
    port: Port = 50061
    """gRPC port of each worker."""


class DecodeSpec(RoleSpec):
    disagg_threshold: Annotated[int, Field(ge=1)] = 512
    """Uncached prompt tokens below which a decode worker prefills locally."""
    reserve_wait_seconds: Annotated[float, Field(ge=0)] = 1.0
    """How long a decode worker waits for KV room for a remote prefill's prompt (retrying as blocks free) before
    it sends the request back to the gateway as busy (the gateway tries another decode worker, or this one after
    a pause, within router.queueTimeoutSeconds). A decode worker never prefills a long prompt itself for want
    of blocks: that would stall every stream it decodes."""


class RatioSpec(Spec):
    """Bounds on prefill replicas / decode replicas."""

    min: Annotated[float, Field(ge=0)] | None = None
    """Lowest prefill:decode ratio (e.g. 0.25 for 1:4); none: unbounded."""
    max: Annotated[float, Field(gt=0)] | None = None
    """Highest prefill:decode ratio (e.g. 1.0 for 1:1); none: unbounded."""

    @model_validator(mode="after")
    def _order(self) -> RatioSpec:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min: {self.min} is above max ({self.max})")
        return self


class SLOSpec(Spec):
    ttft_seconds: Seconds = 2.0
    """Time-to-first-token objective (p90 over the autoscaler's window)."""
    itl_seconds: Seconds = 0.1
    """Inter-token latency objective (p90 over the autoscaler's window)."""


class AutoscalingSpec(Spec):
    mode: Literal["manual", "slo", "external"] = "manual"
    """manual: replicas as written; slo: the built-in autoscaler; external: HPA/KEDA through the scale subresource."""
    interval_seconds: Seconds = 15.0
    """How often the autoscaler decides."""
    scale_up_cooldown_seconds: Annotated[float, Field(ge=0)] = 30.0
    """Least time between two scale-ups of a role (twice this while the prompt load is smooth)."""
    scale_down_cooldown_seconds: Annotated[float, Field(ge=0)] = 300.0
    """Least time after any change before a role scales down, and the stabilisation window: a trough shorter than this keeps its replicas. Under 60 s it is also the window the need is averaged over, so a trough this long does release them. While the prompt load is smooth the law waits 2/3 of this."""
    gpu_budget: Annotated[int, Field(ge=1)] | None = None
    """Most GPUs the cluster's workers may hold together; none: no cap."""
    cold_start_seconds: Seconds | None = None
    """Measured seconds from asking for a worker to its first request (process or pod start, weights, warm-up). The autoscaler plans every start with it: scale-up leads the forecast load by this much, and a start is weighed against a role flip. none: the replica profile's measurement for the cluster's engine (an H200, 8B model: native 20 s, vllm 150 s, whose torch.compile and CUDA graphs take most of it)."""
    role_flips: bool = False
    """Let the autoscaler move workers between prefill and decode without a restart when the total is right but the split is wrong: a worker stops taking its old role's work, drains it, and serves the other role within flipSeconds. Starts and stops are kept for the remainder. The workers must be able to run either role."""
    flip_seconds: Seconds | None = None
    """Seconds a drained worker takes to serve the other role (re-registration, every gateway's view following); its drain is its own requests'. none: the replica profile's."""
    warm_replicas: Count = 0
    """Ready replicas per role kept above the planned need, to serve a burst while new ones load."""
    warm_prefill_replicas: Count | None = None
    """Prefill's warm replicas, instead of warmReplicas; none: warmReplicas."""
    warm_decode_replicas: Count | None = None
    """Decode's warm replicas, instead of warmReplicas; none: warmReplicas."""
    bursts: Literal["chase", "hold"] = "chase"
    """chase: a burst scales the role it loads up at once, and its capacity is kept a while in case it recurs. hold: while the prompt load is not smooth, each role holds the 60% quantile of its need over the last 900 s (a higher one while those 900 s fill, from the largest need seen) plus its warm replicas, and no replica is started for a burst. Hold is for bursts shorter than a cold start, which a replica started for them reaches after they end: with warm replicas sized for the bursts it serves as many for fewer GPU-seconds (Azure code: 6 prefill + 4 decode; docs/autoscaling.md, issue 40's seventh and eighth passes). With few warm replicas every burst misses."""
    planner_interval_seconds: Seconds = 60.0
    """How often the slow loop re-plans each pool from the forecast load (the fast loop runs every interval)."""
    target_utilization: Annotated[float, Field(gt=0.2, le=0.9)] = 0.8
    """Fraction of a replica's capacity at the SLO (its prefill or decode tokens/s within the TTFT/ITL objectives) a role is sized to fill: replicas = ceil(need / target). A role scales up when its planned need exceeds target + 0.1 of its replicas and down when under target - 0.2. The autoscaler lowers it while a role misses its objectives (to 0.7x) and raises it while well inside (up to 0.95); prefill's is also capped by the queueing the TTFT objective allows. While the prompt load is smooth the law aims 0.048 lower."""


class SecretKeyRef(Spec):
    """A key of a Kubernetes Secret."""

    name: str = Field(min_length=1)
    """The Secret's name."""
    key: str = Field(min_length=1)
    """The key inside the Secret."""


class KVAwareSpec(Spec):
    """The kv_aware policy's cost, in KV blocks (docs/routing.md): overlapWeight x blocks to compute + blocks
    waiting for prefill + decodeWeight x blocks decoding."""

    overlap_weight: Annotated[float, Field(ge=0)] = 4.0
    """Weight of the prompt blocks a worker would have to compute (what a cache hit saves): 4 lets a worker's
    cached prefix outweigh up to 3x as many blocks of load queued there (docs/routing.md)."""
    decode_weight: Annotated[float, Field(ge=0)] = 1.0
    """Weight of the blocks of requests decoding on a worker (its decode load)."""
    pool_credit: Annotated[float, Field(ge=0, le=1)] = 0.8
    """Share of a block's cost saved when it can be loaded from the KV pool instead of computed (a tier below
    a worker's own memory)."""
    session_slack_blocks: Count = 256
    """A session stays on its worker unless that worker's load exceeds the least loaded's by this many blocks."""


class SpillSpec(Spec):
    """When the gateway lets a decode worker prefill a long prompt itself instead of queueing it at a busy prefill
    worker (conditional disaggregation, docs/routing.md): when its first token comes no later there, by the
    gateways' accounting of both pools, and the decode worker's own prompts stay few. A prefill burst is
    absorbed by decode's spare compute while prefill replicas load. The token defaults are about 0.4 s, 0.2 s
    and 25 ms of an 8B model's prefill on an H200; scale them with the hardware."""

    prefill_backlog_tokens: Count = 16384
    """A long prompt may be prefilled by its decode worker only while the prefill worker it would go to has at least
    this many prompt tokens waiting (0: never)."""
    local_backlog_tokens: Count = 8192
    """... and the decode worker would then have at most this many prompt tokens of its own to prefill, this
    prompt's included (its decode steps slow down while it prefills)."""
    local_share: Annotated[float, Field(ge=0, le=1)] = 0.5
    """... and its first token comes no later there: a decode worker's prefill speed beside its decodes, as a share
    of a prefill worker's (engine.maxPrefillTokensWhileDecoding against the prefill workers' maxNumBatchedTokens,
    roughly); 0 leaves this test out."""
    handover_tokens: Count = 1024
    """What handing a prompt's KV over adds to its first token (the transfer's tail, the extra hop), in prompt
    tokens of prefill time: it counts against the prefill worker in that comparison."""


class RouterSpec(Spec):
    replicas: Annotated[int, Field(ge=1)] = 1
    """Gateway replicas (active-active)."""
    port: Port = 8000
    """HTTP port of the OpenAI-compatible API."""
    policy: Literal["least_loaded", "round_robin", "kv_aware"] = "least_loaded"
    """How a request's workers are chosen."""
    kv_aware: KVAwareSpec = Field(default_factory=KVAwareSpec)
    """Weights of the kv_aware policy."""
    spill: SpillSpec = Field(default_factory=SpillSpec)
    """When a long prompt is prefilled by its decode worker because the prefill workers are backed up."""
    max_inflight: Annotated[int, Field(ge=1)] = 256
    """Requests running at once on one gateway; more wait in its queue."""
    max_queue: Count = 1024
    """Requests waiting for a seat on one gateway; more get 429 with Retry-After."""
    queue_timeout_seconds: Seconds = 300.0
    """How long a request may wait for a seat (or for a busy worker to answer again) before a 429."""
    max_body_bytes: Annotated[int, Field(ge=1024)] = 16 << 20
    """Largest request body, in bytes; larger bodies get 413 before they are read."""
    max_prompt_chars: Annotated[int, Field(ge=1)] | None = None
    """Longest prompt in characters, checked before tokenizing (default: 32 per token of context)."""
    health_interval_seconds: Seconds = 1.0
    """How often each worker's health is checked."""
    health_failures: Annotated[int, Field(ge=1)] = 3
    """Failed health checks in a row before a worker that still accepts connections counts as unresponsive."""
    migration_limit: Count = 3
    """How often one request may move to another decode worker after its stream failed mid-way (the worker died,
    stalled or ran out of drain time); it continues from the tokens already sent. 0: never."""
    stall_seconds: Annotated[float, Field(ge=0)] = 30.0
    """A stream that has sent its first token and then nothing for this long moves to another worker (0: never), and so does a moved stream whose next worker sends nothing for twice as long (it computes the context again); each such move doubles the request's window, so a worker that is slow, not stopped, does not bounce it."""
    api_key_secret: SecretKeyRef | None = None
    """Kubernetes: a Secret key holding the gateway's API keys (comma-separated); clients send one as a Bearer token."""
    resources: dict[str, dict[str, int | str]] = Field(default_factory=dict)
    """Kubernetes: the gateway container's resource requests and limits."""


class RedisSpec(Spec):
    mode: Literal["none", "bundled", "external"] = "none"
    """none: no Redis (static membership, load-only routing); bundled: one started with the cluster; external: `url`."""
    url: str | None = Field(None, pattern=r"^rediss?://")
    """redis:// URL of an external Redis or Redis Cluster (for bundled: filled in by whoever starts it)."""
    lease_seconds: Annotated[float, Field(ge=1)] = 5.0
    """A worker's registry entry expires this long after its last refresh (it refreshes every second)."""
    snapshot_seconds: Annotated[float, Field(ge=1)] = 30.0
    """How often one gateway stores a snapshot of the KV index (new gateways start from it)."""

    @model_validator(mode="before")
    @classmethod
    def _url_means_external(cls, data: Any) -> Any:
        """A URL with no mode (e.g. `--redis-url`) means that Redis."""
        if isinstance(data, dict) and data.get("url") and data.get("mode", "none") == "none":
            data = {**data, "mode": "external"}
        return data

    def resolved_url(self) -> str | None:
        """The URL to use, if any: `url`, or the SPLITSERVE_REDIS_URL environment variable (a Secret on
        Kubernetes); none when mode is none."""
        import os

        if self.mode == "none":
            return None
        return self.url or os.environ.get("SPLITSERVE_REDIS_URL") or None
    url_secret: SecretKeyRef | None = None
    """Kubernetes: a Secret key holding the external Redis URL (instead of `url`)."""


class MembershipSpec(Spec):
    """How workers find each other: a static list, or the Redis registry."""

    prefill: list[str] = Field(default_factory=list)
    """Static prefill worker endpoints (host:port), when there is no Redis registry."""
    decode: list[str] = Field(default_factory=list)
    """Static decode (or colocated) worker endpoints (host:port), when there is no Redis registry."""

    @field_validator("prefill", "decode")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        for ep in v:
            host, _, port = ep.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{ep!r} is not host:port")
        return v


class KVTransferSpec(Spec):
    backend: Literal["auto", "nixl", "tcp"] = "auto"
    """auto (NIXL when it starts, else TCP), nixl or tcp."""
    timeout_seconds: Seconds = 30.0
    """How long one request's KV transfer may take before the decode worker prefills locally."""


class KVPoolSpec(Spec):
    """The Redis-backed KV pool (docs/kv_pool.md): blocks outlive a worker's memory and move between workers."""

    enabled: bool = False
    """Keep KV blocks in the Redis KV pool and load them instead of recomputing."""
    write_from: list[Literal["prefill", "decode"]] = Field(default_factory=lambda: ["prefill", "decode"])
    """Which roles write the blocks they compute (a colocated worker counts as decode)."""
    min_load_tokens: Annotated[int, Field(ge=1)] = 64
    """Fewest prompt tokens found in the pool (beyond a worker's own cache) worth a load."""
    prefill_tokens_per_second: Annotated[float, Field(gt=0)] | None = None
    """The workers' prefill speed; with it, a load happens only when its estimated time (bytes over the
    measured read bandwidth) is below recomputing. None: always load past minLoadTokens."""
    read_timeout_seconds: Seconds = 5.0
    """A pool read slower than this is abandoned and the prompt recomputed; native workers' pool link to Redis
    waits this long on its socket (the worker's own link, for the registry, waits 1 s)."""
    lookup_timeout_seconds: Seconds = 0.2
    """engine vllm: the scheduler's pool lookup (one pipelined EXISTS inside vLLM's scheduling loop) is given up
    after this and the prompt computed. Native workers bound lookup and read together by readTimeoutSeconds."""
    write_queue_blocks: Annotated[int, Field(ge=1)] = 4096
    """Blocks waiting to be written at most; past it new ones are dropped (and counted), never waited for."""
    blocks_per_copy: Annotated[int, Field(ge=1)] = 32
    """Blocks copied out of the KV cache at once between two engine steps (bounds the pause per step)."""
    ttl_seconds: Annotated[int, Field(ge=60)] = 86400
    """Pool blocks expire after this long; under memory pressure Redis evicts the least recently used first."""
    max_memory: str = Field("1gb", pattern=r"^[0-9]+(b|kb|mb|gb)?$")
    """The bundled Redis's memory limit (maxmemory); pool blocks are evicted LRU past it."""


class VllmSpec(Spec):
    """Workers with engine vllm: a stock vLLM OpenAI server beside each splitserve worker (docs/engines.md)."""

    args: list[str] = Field(default_factory=list)
    """Extra arguments for every vLLM server (a role's engine.vllmArgs follow them), e.g. [--quantization, fp8];
    flags splitserve sets from the model are refused."""
    port: Port = 8200
    """Kubernetes: the vLLM server's HTTP port inside a worker pod (local runs pick free ports)."""
    events_port: Port = 5557
    """Kubernetes: the port of the vLLM server's KV event publisher (ZMQ) inside a worker pod."""
    connector: Literal["layerwise", "push", "pull"] = "layerwise"
    """How a disaggregated decode worker's vLLM server gets a prompt's KV: layerwise (splitserve's connector: the
    decode server reserves blocks first and the prefill server writes each layer into them while it computes),
    push (vLLM's NixlPushConnector: the prefill server writes the whole prompt once computed) or pull (vLLM's
    NixlConnector: the decode server reads it once computed)."""
    side_channel_port: Port = 5600
    """Kubernetes: the NIXL handshake port inside a worker pod (disaggregated mode): the NixlConnector's, or where
    the layerwise connector serves its NIXL metadata (a tensor-parallel rank r at this port + r)."""
    control_port: Port = 5558
    """Kubernetes: the port of the worker's line to the layerwise connector inside its vLLM server (loopback,
    inside a worker pod)."""
    startup_seconds: Seconds = 1200.0
    """How long a vLLM server may take to answer /health after it starts (model load, profiling, compilation)."""

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        return check_vllm_args(v)


class ImagesSpec(Spec):
    worker: str = "ghcr.io/splitserve/worker:0.1.0"
    """Kubernetes: the worker image (CUDA, torch, NIXL)."""
    vllm: str = "docker.io/vllm/vllm-openai:v0.26.0"
    """Kubernetes: the vLLM server image of engine vllm workers (its worker container runs the splitserve worker image beside it)."""
    gateway: str = "ghcr.io/splitserve/gateway:0.1.0"
    """Kubernetes: the slim gateway image (no torch)."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes: when to pull the images."""
    redis: str = "docker.io/library/redis:7.4-alpine"
    """Kubernetes: the bundled Redis's image (redis.mode: bundled)."""


class LocalObjectReference(Spec):
    """A Kubernetes object in the same namespace, by name."""

    name: str = Field(min_length=1)
    """The object's name."""


class KubernetesSpec(Spec):
    """Kubernetes: how the operator shapes pods and Services (`splitserve up` ignores this section)."""

    host_ipc: bool = False
    """Kubernetes: run worker pods in the node's IPC namespace (NIXL/UCX shared-memory transfers between pods on one node)."""
    shm_size: str | None = Field(None, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")
    """Kubernetes: size of a memory-backed /dev/shm in worker pods (e.g. 16Gi for NCCL/NIXL); none: the runtime's 64 MiB."""
    model_volume: dict[str, Any] = Field(default_factory=dict)
    """Kubernetes: a volume source holding the model, e.g. {persistentVolumeClaim: {claimName: llama}}, mounted read-only at modelMountPath in workers and gateways."""
    model_mount_path: str = Field("/models", pattern=r"^/[^:]*$")
    """Kubernetes: where modelVolume is mounted (model.name then names a directory under it)."""
    gateway_service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Kubernetes: the type of the gateway's Service (how clients outside the cluster reach it)."""
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    """Kubernetes: Secrets (type kubernetes.io/dockerconfigjson) the pods pull their images with, e.g. [{name: regcred}]."""
    pod_security_context: dict[str, Any] = Field(default_factory=dict)
    """Kubernetes: keys merged over every pod's securityContext (default: runAsNonRoot, runAsUser and runAsGroup 10001, seccompProfile RuntimeDefault: the restricted Pod Security Standard)."""
    security_context: dict[str, Any] = Field(default_factory=dict)
    """Kubernetes: keys merged over every container's securityContext (default: allowPrivilegeEscalation false, capabilities drop ALL, readOnlyRootFilesystem true)."""
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    """Kubernetes: annotations on every pod the operator creates."""
    pod_labels: dict[str, str] = Field(default_factory=dict)
    """Kubernetes: extra labels on every pod the operator creates (its own labels win on a clash)."""
    priority_class_name: str | None = None
    """Kubernetes: the PriorityClass of every pod the operator creates."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Kubernetes: node labels every pod must run on (a role's nodeSelector adds to it)."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Kubernetes: tolerations of every pod (a role's tolerations are added to them)."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """Kubernetes: affinity of every pod (a role's affinity replaces it for that role's pods)."""


class ClusterSpec(Spec):
    """One served model: its workers, router, autoscaling and the shared services they use."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    """The served model and its engine-wide settings."""
    engine: EngineKind = DEFAULT_ENGINE
    """The engine every worker runs: native (splitserve's own) or vllm (a vLLM server beside each worker); a
    role's engine.kind overrides it."""
    vllm: VllmSpec = Field(default_factory=VllmSpec)
    """Settings of vLLM servers (workers with engine vllm)."""
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    """disaggregated: prefill and decode workers; colocated: `decode` workers do both."""
    prefill: PrefillSpec = Field(default_factory=PrefillSpec)
    """Prefill workers (disaggregated mode)."""
    decode: DecodeSpec = Field(default_factory=DecodeSpec)
    """Decode workers (colocated workers in colocated mode)."""
    ratio: RatioSpec = Field(default_factory=RatioSpec)
    """Bounds on prefill:decode replicas."""
    slo: SLOSpec = Field(default_factory=SLOSpec)
    """Latency objectives."""
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Who sets replicas, and how."""
    router: RouterSpec = Field(default_factory=RouterSpec)
    """The OpenAI-compatible gateway."""
    redis: RedisSpec = Field(default_factory=RedisSpec)
    """Redis: worker registry, KV index events, KV pool."""
    membership: MembershipSpec = Field(default_factory=MembershipSpec)
    """Static worker endpoints (used when there is no Redis registry)."""
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    """Moving KV from prefill to decode workers."""
    kv_pool: KVPoolSpec = Field(default_factory=KVPoolSpec)
    """The Redis-backed KV pool."""
    images: ImagesSpec = Field(default_factory=ImagesSpec)
    """Kubernetes: container images."""
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)
    """Kubernetes: pod and Service settings the operator applies (ignored by local runs)."""

    @model_validator(mode="after")
    def _cluster(self, info: ValidationInfo) -> ClusterSpec:
        if self.decode.replicas < 1:
            raise ValueError("decode.replicas: at least one decode (or colocated) worker is needed")
        if self.mode == "disaggregated" and self.prefill.replicas < 1:
            raise ValueError("prefill.replicas: disaggregated mode needs at least one prefill worker")
        # Colocated clusters run no prefill workers. A file may leave prefill.replicas at its default (an API
        # server fills the default in), but a value asked for (any other value, or a flag: the context's
        # `explicit` field paths) is an error rather than silently ignored.
        explicit = "prefill.replicas" in ((info.context or {}).get("explicit") or ())
        default = PrefillSpec.model_fields["replicas"].default
        if self.mode == "colocated" and self.prefill.replicas and (explicit or self.prefill.replicas != default):
            raise ValueError(f"prefill.replicas: colocated mode runs no prefill workers (got "
                             f"{self.prefill.replicas}); decode.replicas sets the colocated workers, or use "
                             f"mode disaggregated")
        self._engines()
        for name, role in (("prefill", self.prefill), ("decode", self.decode)):
            if not role.min_replicas <= role.replicas <= role.max_replicas:
                raise ValueError(f"{name}.replicas: {role.replicas} is outside minReplicas..maxReplicas "
                                 f"({role.min_replicas}..{role.max_replicas})")
        return self

    def _engines(self) -> None:
        """What a role's engine cannot honour is refused here (each engine's own checks, `common.engines`), naming
        the field, never silently ignored."""
        kinds = {name: self.engine_of(name) for name in ("prefill", "decode")}
        if self.mode == "disaggregated" and kinds["prefill"] != kinds["decode"]:
            raise ValueError(f"prefill.engine.kind: prefill workers run {kinds['prefill']} and decode workers "
                             f"{kinds['decode']}; a KV handover is the engine's own, so both roles need one engine")
        roles = ("prefill", "decode") if self.mode == "disaggregated" else ("decode",)
        engines.get(kinds[roles[0]]).check(self, roles)  # the roles that run workers run one engine

    def gpus_per_worker(self, name: str) -> int:
        """GPUs one worker of role `name` uses: tensor-parallel size times its data-parallel ranks."""
        return self.model.tensor_parallel_size * self.role(name).engine.data_parallel_size

    def engine_of(self, name: str) -> EngineKind:
        """The engine a worker of role `name` (prefill, decode or both) runs."""
        return self.role(name).engine.kind or self.engine

    def role(self, name: str) -> RoleSpec:
        """The spec a worker of role `name` (prefill, decode or both) runs with."""
        return self.prefill if name == "prefill" else self.decode

    def pools(self) -> list[str]:
        """The worker pools the cluster runs: prefill and decode, or decode alone in colocated mode."""
        return ["decode"] if self.mode == "colocated" else ["prefill", "decode"]

    def worker_role(self, pool: str) -> str:
        """The role a worker of `pool` runs (`splitserve worker --role`): colocated clusters run their decode
        pool as `both`."""
        return "both" if pool == "decode" and self.mode == "colocated" else pool


class Metadata(BaseModel):
    """Kubernetes object metadata: `name` is required; whatever else kubectl writes is kept as is."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    """The cluster's name (DNS label: lowercase letters, digits and '-')."""
    namespace: str | None = None
    """Kubernetes namespace."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Labels copied to everything the operator creates."""


class ClusterResource(Spec):
    """A SplitServeCluster document: what `splitserve up -f` runs and `kubectl apply -f` creates."""

    api_version: Literal["splitserve.dev/v1alpha1"] = API_VERSION
    """Always splitserve.dev/v1alpha1."""
    kind: Literal["SplitServeCluster"] = KIND
    """Always SplitServeCluster."""
    metadata: Metadata = Field(default_factory=lambda: Metadata(name="splitserve"))
    """The cluster's name and labels."""
    spec: ClusterSpec = Field(default_factory=ClusterSpec)
    """What to run."""
    status: dict[str, Any] | None = None
    """Written by the operator; ignored on input."""
