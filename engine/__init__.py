"""The native PyTorch engine: models, paged KV cache, scheduler, sampler.

Both worker roles run it; `LLMEngine` is the synchronous core, `AsyncEngine` drives it from a thread.
"""

from splitserve.common.hashing import hash_block_tokens, hash_token_blocks
from splitserve.common.sampling import SamplingParams
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.outputs import RequestOutput

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
