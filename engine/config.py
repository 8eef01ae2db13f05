"""Engine configuration: one small dataclass per component, composed into `EngineConfig`, built from the
configuration model by `engine_config` (the engine's own, derived view; users never write it).

Values measured at run time (the number of KV blocks) live in `KVCacheSpec`, apart from user config.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from splitserve.common.config import EngineSpec, ModelSpec, parse_memory


@dataclass
class ModelConfig:
    model: str = "smollm2"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    max_model_len: int | None = None
    served_model_name: str | None = None
    load_format: str = "auto"  # auto: the checkpoint's weights; dummy: random weights (benchmarks)
    enforce_eager: bool = False  # CUDA: no decode graphs
    batch_invariant: bool = False  # each row's math independent of the step's other rows (EngineSpec's docstring)

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len!r}")


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: str | int | float = "auto"  # bytes, '1GiB', or a fraction of free memory
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size!r}")
        if self.kv_cache_memory != "auto":
            parse_memory(self.kv_cache_memory)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority
    # a prompt's chunk in one step at most (vLLM's name); 0: the step's budget
    long_prefill_token_threshold: int = 0
    # prompt tokens in one step at most while the step carries decodes (bounds its time, the streams' inter-token
    # latency); 0: the step's budget
    max_prefill_tokens_while_decoding: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}")
        for name in ("long_prefill_token_threshold", "max_prefill_tokens_while_decoding"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1  # processes (one per GPU) sharing each layer
    expert_parallel: bool = False  # MoE: spread whole experts over the ranks instead of splitting each one
    # module:callable building each follower rank's KV connector (the worker side of KV streaming), e.g.
    # splitserve.kv_transfer.rank_connector:follower_connector; "" for none
    rank_connector: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        d = json.loads(text)
        return cls(ModelConfig(**d["model"]), CacheConfig(**d["cache"]), SchedulerConfig(**d["scheduler"]),
                   ParallelConfig(**d["parallel"]), int(d["seed"]))


@dataclass(frozen=True)
class KVCacheSpec:
    """What the KV cache turned out to be at run time."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str

    @property
    def block_bytes_per_layer(self) -> int:  # bytes of one block of K (or of V) in one layer
        itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize


def engine_config(model: ModelSpec, engine: EngineSpec) -> EngineConfig:
    """The engine's configuration for a worker running `model` with a role's `engine` settings (from the one
    configuration model, `splitserve.common.config`, which validates every value a user can write)."""
    return EngineConfig(
        model=ModelConfig(model.name, dtype=model.dtype, device=model.device, max_model_len=model.max_model_len,
                          served_model_name=model.served_model_name, load_format=model.load_format,
                          enforce_eager=model.enforce_eager, batch_invariant=engine.batch_invariant),
        cache=CacheConfig(block_size=model.block_size, kv_cache_memory=engine.kv_cache_memory,
                          enable_prefix_caching=engine.enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=engine.max_num_batched_tokens,
                                  max_num_seqs=engine.max_num_seqs, policy=engine.scheduling_policy,
                                  long_prefill_token_threshold=engine.long_prefill_token_threshold,
                                  max_prefill_tokens_while_decoding=engine.max_prefill_tokens_while_decoding),
        parallel=ParallelConfig(model.tensor_parallel_size, model.expert_parallel),
        seed=engine.seed,
    )
