"""The `splitserve` command line."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from splitserve.logs import setup_logging

app = typer.Typer(help="splitserve: disaggregated prefill/decode LLM serving.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


def fail(message: str, code: int = 2) -> None:
    """One clear line on stderr, then exit (never a traceback for user errors)."""
    typer.echo(f"splitserve: error: {message}", err=True)
    raise typer.Exit(code)


@app.command("fetch-model")
def fetch_model(name: Annotated[str, typer.Argument(help="embedded model name")] = "smollm2") -> None:
    """Download and convert an embedded model into ~/.cache/splitserve (once)."""
    setup_logging()
    from splitserve.engine.model_files import ModelNotFoundError, fetch_embedded

    try:
        path = fetch_embedded(name)
    except ModelNotFoundError as e:
        fail(str(e))
    typer.echo(str(path))


@app.command()
def generate(
    prompt: Annotated[str, typer.Option(help="prompt text")],
    model: Annotated[str, typer.Option(help="smollm2, a Hugging Face model directory, or a .gguf file")] = "smollm2",
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = False,
    max_tokens: Annotated[int, typer.Option(help="tokens to generate")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 1.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = off")] = 0,
    seed: Annotated[int | None, typer.Option(help="per-request seed (same seed, same output)")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="keep generating past end-of-sequence")] = False,
    dtype: Annotated[str, typer.Option(help="auto, float32 or bfloat16")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
    kv_cache_memory: Annotated[str, typer.Option(help="bytes (e.g. 512MiB) or a fraction of free memory")] = "auto",
    block_size: Annotated[int, typer.Option(help="tokens per KV block")] = 16,
    tensor_parallel_size: Annotated[int, typer.Option(help="GPUs sharing each layer, one process each")] = 1,
    expert_parallel: Annotated[bool, typer.Option(help="MoE: spread experts over the tensor-parallel GPUs")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object with token_ids and text")] = False,
) -> None:
    """Run the engine offline on one prompt."""
    setup_logging("warning" if as_json else None)
    from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams
    from splitserve.engine.config import ParallelConfig
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.model_files import ModelNotFoundError

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=list(stop or []), ignore_eos=ignore_eos)
        config = EngineConfig(model=ModelConfig(model, dtype=dtype, device=device),
                              cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory),
                              parallel=ParallelConfig(tensor_parallel_size, expert_parallel))
        engine = LLMEngine(config)
        try:
            if engine.tokenizer is None:
                fail(f"{model} has no tokenizer files; generate needs text input")
            tok = engine.tokenizer
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
            result = engine.generate([ids], params)[0]
        finally:
            engine.close()
    except (ModelNotFoundError, ValueError, FileNotFoundError, KeyError, RuntimeError) as e:
        fail(str(e).strip("'\""))
    if as_json:
        sys.stdout.write(json.dumps({
            "token_ids": result["token_ids"],
            "text": result["text"],
            "finish_reason": result["finish_reason"],
            "prompt_tokens": len(ids),
        }) + "\n")
    else:
        typer.echo(result["text"])


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _worker(**opts) -> None:
    """Run a worker; `opts` are WorkerConfig's fields (prefill_peers as one comma list)."""
    import asyncio

    from splitserve.engine.model_files import ModelNotFoundError, resolve_model
    from splitserve.worker import WorkerConfig, serve

    setup_logging()
    try:
        resolve_model(opts["model"])
        cfg = WorkerConfig(**{**opts, "prefill_peers": _split(opts["prefill_peers"])})
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))
    asyncio.run(serve(cfg))


_M = typer.Option(help="smollm2, a Hugging Face model directory, or a .gguf file")
_ROLE = typer.Option(help="prefill, decode or both (colocated); `splitserve prefill`/`decode` fix it")


def _worker_command(fixed_role: str | None, default_port: int):
    """One option set for `prefill`, `decode` (role fixed) and `worker` (role chosen with --role)."""

    def command(
        role: Annotated[str, _ROLE] = fixed_role or "both",
        model: Annotated[str, _M] = "smollm2",
        host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="gRPC port")] = default_port,
        metrics_port: Annotated[int, typer.Option(help="HTTP port for /metrics, /healthz, /readyz (0: off)")] = 0,
        kv_transport: Annotated[str, typer.Option(help="auto, nixl or tcp")] = "auto",
        kv_cache_memory: Annotated[str, typer.Option(help="bytes (e.g. 1GiB) or a fraction of free memory")] = "auto",
        block_size: Annotated[int, typer.Option()] = 16,
        max_num_seqs: Annotated[int, typer.Option()] = 128,
        max_num_batched_tokens: Annotated[int, typer.Option()] = 2048,
        max_model_len: Annotated[int | None, typer.Option()] = None,
        dtype: Annotated[str, typer.Option(help="auto, float32 or bfloat16")] = "auto",
        device: Annotated[str, typer.Option(help="auto, cpu or cuda")] = "auto",
        prefill_peers: Annotated[str | None, typer.Option(help="decode role: prefill workers host:port,...")] = None,
        disagg_threshold: Annotated[int, typer.Option(help="uncached prompt tokens below which decode prefills locally")] = 512,
        transfer_timeout: Annotated[float, typer.Option(help="seconds a KV transfer may take")] = 30.0,
        threads: Annotated[int, typer.Option(help="torch threads (0: default)")] = 0,
        served_model_name: Annotated[str | None, typer.Option()] = None,
        tensor_parallel_size: Annotated[int, typer.Option(help="GPUs sharing each layer, one process each")] = 1,
        expert_parallel: Annotated[bool, typer.Option(help="MoE: spread experts over the tensor-parallel GPUs")] = False,
    ) -> None:
        if fixed_role is not None and role != fixed_role:
            fail(f"`splitserve {fixed_role}` always runs the {fixed_role} role; use `splitserve worker --role {role}`")
        _worker(role=role, model=model, host=host, port=port, metrics_port=metrics_port, kv_transport=kv_transport,
                kv_cache_memory=kv_cache_memory, block_size=block_size, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, dtype=dtype,
                device=device, prefill_peers=prefill_peers, disagg_threshold=disagg_threshold,
                transfer_timeout=transfer_timeout, threads=threads, served_model_name=served_model_name,
                tensor_parallel_size=tensor_parallel_size, expert_parallel=expert_parallel)

    return command


app.command("prefill", help="Run a prefill worker (computes prompts, streams their KV out).")(
    _worker_command("prefill", 50061))
app.command("decode", help="Run a decode worker (KV streamed in from prefill workers; local fallback).")(
    _worker_command("decode", 50051))
app.command("worker", help="Run a worker of any role (`--role both` is the colocated baseline).")(
    _worker_command(None, 50051))


@app.command("router")
def router(
    decode: Annotated[str, typer.Option(help="decode (or colocated) workers host:port,...")],
    prefill: Annotated[str | None, typer.Option(help="prefill workers host:port,...")] = None,
    model: Annotated[str, _M] = "smollm2",
    served_model_name: Annotated[str | None, typer.Option()] = None,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    max_inflight: Annotated[int, typer.Option(help="requests in flight before 429")] = 256,
) -> None:
    """Run the OpenAI-compatible gateway."""
    import asyncio

    from splitserve.engine.model_files import ModelNotFoundError
    from splitserve.router.app import RouterConfig, serve

    setup_logging()
    try:
        cfg = RouterConfig(model=model, served_model_name=served_model_name, decode=_split(decode),
                           prefill=_split(prefill), host=host, port=port, max_inflight=max_inflight)
        from splitserve.engine.model_files import resolve_model

        resolve_model(model)
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))
    asyncio.run(serve(cfg))


@app.command("up")
def up(
    port: Annotated[int, typer.Option(help="gateway port")] = 8000,
    prefill: Annotated[int, typer.Option(help="prefill workers (disaggregated mode)")] = 1,
    decode: Annotated[int, typer.Option(help="decode workers (or colocated workers)")] = 1,
    mode: Annotated[str, typer.Option(help="disaggregated or colocated")] = "disaggregated",
    model: Annotated[str, _M] = "smollm2",
    kv_transport: Annotated[str, typer.Option(help="auto, nixl or tcp")] = "auto",
    disagg_threshold: Annotated[int, typer.Option(help="uncached prompt tokens below which decode prefills locally")] = 512,
    kv_cache_memory: Annotated[str, typer.Option()] = "auto",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    served_model_name: Annotated[str, typer.Option()] = "smollm2",
) -> None:
    """Start the gateway plus prefill and decode workers as local processes; Ctrl-C stops them all."""
    from splitserve.engine.model_files import ModelNotFoundError, resolve_model
    from splitserve.launcher import LaunchConfig, run

    setup_logging()
    try:
        resolve_model(model)
        cfg = LaunchConfig(port=port, num_prefill=prefill, num_decode=decode, mode=mode, model=model, host=host,
                           kv_transport=kv_transport, disagg_threshold=disagg_threshold,
                           kv_cache_memory=kv_cache_memory, served_model_name=served_model_name)
    except (ModelNotFoundError, ValueError) as e:
        fail(str(e))
    raise typer.Exit(run(cfg))


@app.command("bench")
def bench(
    url: Annotated[str, typer.Option(help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")],
    model: Annotated[str, typer.Option(help="model name to request")] = "smollm2",
    num_requests: Annotated[int, typer.Option(help="requests to send")] = 32,
    rate: Annotated[float, typer.Option(help="Poisson arrival rate, requests/s (0: all at once)")] = 1.0,
    trace: Annotated[str | None, typer.Option(help="replay a trace: Mooncake .jsonl or Azure .csv")] = None,
    time_scale: Annotated[float, typer.Option(help="multiply trace inter-arrival times by this")] = 1.0,
    input_len: Annotated[int, typer.Option(help="prompt tokens (Poisson mode)")] = 256,
    output_len: Annotated[int, typer.Option(help="output tokens (Poisson mode)")] = 32,
    max_input_len: Annotated[int, typer.Option(help="clip trace prompt lengths")] = 4096,
    max_output_len: Annotated[int, typer.Option(help="clip trace output lengths")] = 512,
    vocab_low: Annotated[int, typer.Option(help="lowest token id used in synthetic prompts")] = 1000,
    vocab_high: Annotated[int, typer.Option(help="highest token id (exclusive) in synthetic prompts")] = 30000,
    slo_ttft: Annotated[float, typer.Option(help="TTFT SLO in seconds (goodput)")] = 2.0,
    slo_itl: Annotated[float, typer.Option(help="p99 inter-token latency SLO per request, seconds")] = 0.2,
    timeout: Annotated[float, typer.Option(help="per-request timeout, seconds")] = 600.0,
    seed: Annotated[int, typer.Option()] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="end with one JSON line")] = False,
    plot_path: Annotated[str | None, typer.Option("--plot", help="write latency CDFs to this PNG")] = None,
    progress: Annotated[bool, typer.Option(help="progress bar on stderr")] = True,
) -> None:
    """Load-test an OpenAI-compatible URL (Poisson arrivals or a trace replay)."""
    import asyncio

    from splitserve import bench as b

    setup_logging("warning")
    if num_requests < 1 or rate < 0 or not 0 <= vocab_low < vocab_high:
        fail("num-requests must be >= 1, rate >= 0 and vocab-low < vocab-high")
    vocab = (vocab_low, vocab_high)
    try:
        jobs = (b.load_trace(trace, num_requests, time_scale, max_input_len, max_output_len, vocab, seed) if trace
                else b.poisson_jobs(num_requests, rate, input_len, output_len, vocab, seed))
    except (OSError, ValueError, KeyError) as e:
        fail(f"cannot load trace: {e}")
    results, elapsed = asyncio.run(b.run(url.rstrip("/"), model, jobs, timeout, progress))
    summary = b.summarize(results, elapsed, slo_ttft, slo_itl)
    b.print_table(summary)
    if plot_path:
        try:
            b.plot(results, plot_path)
        except RuntimeError as e:  # report, but keep the results (and the JSON line) coming
            typer.echo(f"splitserve: error: {e}", err=True)
    if as_json:
        print(json.dumps(summary))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
