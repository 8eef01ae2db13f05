"""Building a rank's model runner: pick its device, load its model (or shard), size and allocate its KV cache.

Used by the engine (rank 0) and by the other tensor-parallel ranks alike.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from splitserve.engine.config import EngineConfig, parse_memory
from splitserve.engine.kv_cache_manager import cdiv
from splitserve.engine.model_files import prepare_model
from splitserve.engine.model_runner import DTYPES, ModelRunner
from splitserve.engine.models.loader import load_arch, load_model
from splitserve.engine.parallel import ParallelContext

CPU_DEFAULT_KV_BYTES = 512 << 20


def build_runner(config: EngineConfig, device: torch.device,
                 parallel: ParallelContext | None = None) -> tuple[ModelRunner, int, Path]:
    """Load the model (this rank's shard under tensor parallelism) and size and allocate its KV cache.

    Returns the runner, the number of KV blocks (the minimum over all ranks) and the model directory.
    """
    mc = config.model
    model_dir = prepare_model(mc.model, need_weights=mc.load_format != "dummy")
    dtype_name = mc.dtype if mc.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[dtype_name]
    arch = load_arch(model_dir)
    max_model_len = mc.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's {arch.max_position_embeddings} positions")
    if mc.batch_invariant and device.type == "cuda":
        cuda_batch_invariance()
    model = load_model(model_dir, device, dtype, max_model_len, dummy=mc.load_format == "dummy", parallel=parallel)
    runner = ModelRunner(model, arch, device, dtype, config.cache.block_size, config.seed,
                         cuda_graphs=not mc.enforce_eager, max_model_len=max_model_len,
                         max_num_seqs=config.scheduler.max_num_seqs, parallel=parallel,
                         batch_invariant=mc.batch_invariant)
    num_blocks = _num_kv_blocks(config, runner, device, max_model_len)
    if parallel is not None and parallel.world_size > 1:
        num_blocks = parallel.agree_min(num_blocks)
    runner.init_kv_cache(num_blocks)
    return runner, num_blocks, model_dir


def cuda_batch_invariance() -> None:
    """cuBLAS computes each row of a matmul the same whatever the number of rows once it may not split the
    reduction (split-K, chosen by shape, with a workspace): no workspace, no reduced-precision or split-K
    reduction, cuBLASLt, no TF32 (vLLM's settings for Hopper and Blackwell). The environment variables act only
    if no cuBLAS handle exists yet: this runs before the model is loaded."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    os.environ["CUBLASLT_WORKSPACE_SIZE"] = "1"
    matmul = torch.backends.cuda.matmul
    try:
        matmul.allow_bf16_reduced_precision_reduction = (False, False)
        matmul.allow_fp16_reduced_precision_reduction = (False, False)
    except (TypeError, ValueError):  # a torch without the split-K switch: the workspace above rules it out
        matmul.allow_bf16_reduced_precision_reduction = False
        matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_tf32 = False
    torch.backends.cuda.preferred_blas_library(backend="cublaslt")


def _num_kv_blocks(config: EngineConfig, runner: ModelRunner, device: torch.device, max_model_len: int) -> int:
    per_block = runner.bytes_per_block()
    setting = config.cache.kv_cache_memory
    if setting == "auto":
        # CPU: 512 MiB, or enough for two full-length sequences if that is more
        setting = 0.85 if device.type == "cuda" else max(
            CPU_DEFAULT_KV_BYTES, 2 * per_block * cdiv(max_model_len, config.cache.block_size))
    budget = parse_memory(setting)
    if isinstance(budget, float):
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = int(free * budget)
    return max(1, budget // per_block)



def rank_device(config: EngineConfig, rank: int) -> torch.device:
    want = config.model.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        world = config.parallel.tensor_parallel_size
        if world > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs, "
                             f"{torch.cuda.device_count()} are visible")
        return torch.device("cuda", rank if world > 1 else (torch.device(want).index or 0))
    return torch.device(want)
