"""The native PyTorch engine: models, paged KV cache, scheduler, sampler.

Both worker roles run it; `LLMEngine` is the synchronous core, `AsyncEngine` drives it from a thread.
"""

from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.hashing import hash_block_tokens, hash_token_blocks
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.sampling_params import SamplingParams

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "hash_block_tokens",
    "hash_token_blocks",
]
