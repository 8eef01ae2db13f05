"""The `splitserve` command line: the top layer (nothing imports it).

Commands that run part of a cluster (`up`, `worker`, `prefill`, `decode`, `router`) read one SplitServeCluster
document (`-f FILE`, or the defaults) and take flags generated from the configuration model; a flag overrides
the file. Every user error is one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from splitserve import __version__
from splitserve.cli_k8s import crd, operator, render
from splitserve.cli_options import config_command, flag
from splitserve.cli_simulate import simulate
from splitserve.common import engines
from splitserve.common.config import ClusterResource
from splitserve.common.logs import setup_logging
from splitserve.common.role_flips import FLIP_DRAIN_SECONDS, FLIP_TIMEOUT_SECONDS


def fail(message: str, code: int = 2) -> None:
    """One clear line on stderr, then exit (never a traceback for user errors)."""
    click.echo(f"splitserve: error: {message}", err=True)
    sys.exit(code)


class Group(click.Group):
    def main(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            sys.exit(0)
        except click.UsageError as e:  # a bad flag or file: one line
            fail(e.format_message().replace("\n", " "))
        except click.exceptions.Abort:
            sys.exit(130)
        except click.ClickException as e:
            fail(e.format_message())


@click.group(cls=Group, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
             help="splitserve: disaggregated prefill/decode LLM serving.")
@click.version_option(__version__, "--version", "-V", prog_name="splitserve", message="%(prog)s %(version)s")
def app() -> None:
    pass


# -- model files ------------------------------------------------------------------------------------------
@app.command("fetch-model")
@click.argument("name", default="smollm2")
def fetch_model(name: str) -> None:
    """Download and convert a model into ~/.cache/splitserve (once): `smollm2` or a .gguf file."""
    setup_logging()
    from splitserve.common.model_files import EMBEDDED, ModelNotFoundError
    from splitserve.engine.model_files import fetch_embedded, prepare_model

    try:
        path = fetch_embedded(name) if name in EMBEDDED else prepare_model(name)
    except ModelNotFoundError as e:
        fail(str(e))
    click.echo(str(path))


@app.command("vllm-connector")
@click.argument("directory", type=click.Path(file_okay=False))
def vllm_connector(directory: str) -> None:
    """Copy the KV pool's vLLM connector (and redis-py) into DIRECTORY, for a vLLM image without splitserve:
    run its server with PYTHONPATH=DIRECTORY (worker pods with engine vllm and kvPool do this in an init
    container)."""
    from splitserve.vllm_engine.connector_files import copy_connector

    try:
        written = copy_connector(Path(directory))
    except (OSError, RuntimeError) as e:
        fail(f"cannot write the connector into {directory}: {e}")
    click.echo(f"{len(written)} files in {directory}")


def _prepare(resource: ClusterResource) -> None:
    """Fail early, in one line, when the model's files are missing (converting a GGUF once here)."""
    from splitserve.common.model_files import ModelNotFoundError
    from splitserve.engine.model_files import prepare_model

    model = resource.spec.model
    try:
        prepare_model(model.name, need_weights=model.load_format != "dummy")
        if model.tokenizer:
            prepare_model(model.tokenizer, need_weights=False)
    except ModelNotFoundError as e:
        fail(str(e))


# -- the engine offline -----------------------------------------------------------------------------------
ENGINE_FLAGS = [
    flag("model", "model.name"),
    flag("dtype", "model.dtype"),
    flag("device", "model.device"),
    flag("max-model-len", "model.max_model_len"),
    flag("block-size", "model.block_size"),
    flag("tensor-parallel-size", "model.tensor_parallel_size"),
    flag("expert-parallel", "model.expert_parallel"),
    flag("kv-cache-memory", "prefill.engine.kv_cache_memory", "decode.engine.kv_cache_memory"),
    flag("max-num-seqs", "prefill.engine.max_num_seqs", "decode.engine.max_num_seqs"),
    flag("max-num-batched-tokens", "prefill.engine.max_num_batched_tokens", "decode.engine.max_num_batched_tokens"),
    flag("long-prefill-token-threshold", "prefill.engine.long_prefill_token_threshold",
         "decode.engine.long_prefill_token_threshold"),
    flag("max-prefill-tokens-while-decoding", "prefill.engine.max_prefill_tokens_while_decoding",
         "decode.engine.max_prefill_tokens_while_decoding"),
    flag("threads", "prefill.engine.threads", "decode.engine.threads"),
    flag("batch-invariant", "prefill.engine.batch_invariant", "decode.engine.batch_invariant"),
]


@app.command()
@click.option("--prompt", required=True, help="prompt text")
@click.option("--chat/--no-chat", default=False, help="wrap the prompt in the model's chat template")
@click.option("--max-tokens", type=int, default=64, help="tokens to generate")
@click.option("--temperature", type=float, default=1.0, help="0 = greedy")
@click.option("--top-p", type=float, default=1.0)
@click.option("--top-k", type=int, default=0, help="0 = off")
@click.option("--seed", type=int, default=None, help="per-request seed (same seed, same output)")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--ignore-eos/--no-ignore-eos", default=False, help="keep generating past end-of-sequence")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object with token_ids and text")
@config_command(ENGINE_FLAGS)
def generate(resource: ClusterResource, prompt: str, chat: bool, max_tokens: int, temperature: float, top_p: float,
             top_k: int, seed: int | None, stop: tuple[str, ...], ignore_eos: bool, as_json: bool) -> None:
    """Run the engine offline on one prompt."""
    setup_logging(os.environ.get("SPLITSERVE_LOG_LEVEL", "warning"))
    _prepare(resource)
    from splitserve.common.model_files import ModelNotFoundError
    from splitserve.common.sampling import SamplingParams
    from splitserve.engine.config import engine_config
    from splitserve.engine.llm_engine import LLMEngine

    spec = resource.spec
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=list(stop), ignore_eos=ignore_eos)
        engine = LLMEngine(engine_config(spec.model, spec.decode.engine))
        try:
            if engine.tokenizer is None:
                fail(f"{spec.model.name} has no tokenizer files; generate needs text input")
            tok = engine.tokenizer
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
            if len(ids) + max_tokens > engine.max_model_len:
                fail(f"--max-tokens: the prompt ({len(ids)} tokens) plus {max_tokens} exceeds the context length "
                     f"{engine.max_model_len}")
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
        click.echo(result["text"])


# -- workers ----------------------------------------------------------------------------------------------
WORKER_FLAGS = ENGINE_FLAGS + [
    flag("engine", "engine"),
    flag("vllm-args", "vllm.args", help="engine vllm: extra vLLM server arguments, comma-separated "
         "(e.g. --gpu-memory-utilization,0.45)"),
    flag("served-model-name", "model.served_model_name"),
    flag("load-format", "model.load_format"),
    flag("tokenizer", "model.tokenizer"),
    flag("port", "prefill.port", "decode.port", help="gRPC port of this worker"),
    flag("metrics-port", "prefill.metrics_port", "decode.metrics_port",
         help="HTTP port of this worker: /metrics, /healthz, /readyz, /stats"),
    flag("kv-transport", "kv_transfer.backend"),
    flag("vllm-connector", "vllm.connector"),
    flag("transfer-timeout", "kv_transfer.timeout_seconds"),
    flag("prefill-peers", "membership.prefill", help="decode role: prefill workers host:port,... (no registry)"),
    flag("disagg-threshold", "decode.disagg_threshold"),
    flag("drain-seconds", "prefill.drain_seconds", "decode.drain_seconds"),
    flag("redis-url", "redis.url"),
    flag("kv-pool", "kv_pool.enabled"),
]


def _worker(resource: ClusterResource, role: str, host: str, name: str | None, advertise_host: str | None,
            vllm_url: str | None = None) -> None:
    import asyncio

    from splitserve.worker import PortInUse, run_process

    setup_logging()
    _prepare(resource)
    try:
        code = asyncio.run(run_process(resource, role, host, name, advertise_host, vllm_url))
    except KeyboardInterrupt:
        code = 0
    except PortInUse as e:
        fail(str(e))
    logging.getLogger("splitserve.worker").info("worker %s exiting: code %d", role, code)
    if code:
        sys.exit(code)


def _worker_command(name: str, fixed_role: str | None, help_text: str) -> None:
    @click.option("--host", default="127.0.0.1", show_default=True, help="address to bind")
    @click.option("--name", "worker_name", default=None,
                  help="this worker's name in the registry (default: <hostname>-<port>); keep it across restarts")
    @click.option("--advertise-host", default=None,
                  help="the address peers reach this worker at (default: --host, or this host's address)")
    @click.option("--vllm-url", default=None,
                  help="engine vllm: the vLLM server already serving beside this worker (e.g. "
                       "http://127.0.0.1:8200, its container in the pod) instead of starting one as a child")
    @config_command(WORKER_FLAGS)
    def command(resource: ClusterResource, host: str, worker_name: str | None, advertise_host: str | None,
                vllm_url: str | None, role: str | None = None) -> None:
        if vllm_url is not None and not vllm_url.startswith(("http://", "https://")):
            fail(f"--vllm-url: {vllm_url!r} is not an http:// URL")
        kind = resource.spec.engine_of(fixed_role or role or "both")
        if vllm_url is not None and not engines.get(kind).server_beside:
            fail(f"--vllm-url: this worker's engine is {kind} (give --engine {' or '.join(engines.attaching())})")
        _worker(resource, fixed_role or role or "both", host, worker_name, advertise_host, vllm_url)

    command.__doc__ = help_text
    if fixed_role is None:
        command = click.option("--role", type=click.Choice(["prefill", "decode", "both"]), default="both",
                               show_default=True, help="prefill, decode, or both (colocated)")(command)
    app.command(name, help=help_text)(command)


_worker_command("worker", None, "Run a worker of any role (`--role both` is the colocated baseline).")
_worker_command("prefill", "prefill", "Run a prefill worker (computes prompts, streams their KV out).")
_worker_command("decode", "decode", "Run a decode worker (KV streamed in from prefill workers; local fallback).")


# -- the gateway ------------------------------------------------------------------------------------------
ROUTER_FLAGS = [
    flag("model", "model.name"),
    flag("served-model-name", "model.served_model_name"),
    flag("tokenizer", "model.tokenizer"),
    flag("max-model-len", "model.max_model_len"),
    flag("block-size", "model.block_size"),
    flag("decode", "membership.decode", help="decode (or colocated) workers host:port,... (no registry)"),
    flag("prefill", "membership.prefill", help="prefill workers host:port,... (no registry)"),
    flag("mode", "mode"),
    flag("port", "router.port"),
    flag("routing", "router.policy"),
    flag("max-inflight", "router.max_inflight"),
    flag("spill-backlog", "router.spill.prefill_backlog_tokens"),
    flag("redis-url", "redis.url"),
]


@app.command("router")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to bind")
@config_command(ROUTER_FLAGS)
def router(resource: ClusterResource, host: str) -> None:
    """Run the OpenAI-compatible gateway."""
    import asyncio

    from splitserve.common.model_files import ModelNotFoundError
    from splitserve.router.app import serve
    from splitserve.router.policy import PolicyError

    setup_logging()
    spec = resource.spec
    if not spec.membership.decode and not spec.redis.resolved_url():
        fail("--decode: at least one decode (or colocated) worker endpoint is required (or a Redis registry)")
    try:
        asyncio.run(serve(spec, host))
    except (ModelNotFoundError, PolicyError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        pass


# -- a whole cluster on this machine ----------------------------------------------------------------------
UP_FLAGS = [
    flag("model", "model.name"),
    flag("served-model-name", "model.served_model_name"),
    flag("mode", "mode"),
    flag("engine", "engine"),
    flag("vllm-args", "vllm.args", help="engine vllm: extra vLLM server arguments, comma-separated "
         "(e.g. --quantization,fp8)"),
    flag("prefill", "prefill.replicas", help="prefill workers (disaggregated mode)"),
    flag("decode", "decode.replicas", help="decode workers (or colocated workers)"),
    flag("port", "router.port", help="gateway port"),
    flag("routing", "router.policy"),
    flag("kv-transport", "kv_transfer.backend"),
    flag("vllm-connector", "vllm.connector"),
    flag("transfer-timeout", "kv_transfer.timeout_seconds"),
    flag("disagg-threshold", "decode.disagg_threshold"),
    flag("spill-backlog", "router.spill.prefill_backlog_tokens"),
    flag("kv-cache-memory", "prefill.engine.kv_cache_memory", "decode.engine.kv_cache_memory"),
    flag("redis-url", "redis.url", help="use this Redis instead of starting one (kv_aware routing, the KV pool)"),
    flag("routers", "router.replicas"),
    flag("kv-pool", "kv_pool.enabled"),
    flag("batch-invariant", "prefill.engine.batch_invariant", "decode.engine.batch_invariant"),
    flag("slo-ttft", "slo.ttft_seconds"),
    flag("slo-itl", "slo.itl_seconds"),
    flag("autoscale-interval", "autoscaling.interval_seconds"),
    flag("scale-up-cooldown", "autoscaling.scale_up_cooldown_seconds"),
    flag("scale-down-cooldown", "autoscaling.scale_down_cooldown_seconds"),
]


@app.command("up")
@click.option("--host", default="127.0.0.1", show_default=True, help="address every process binds")
@click.option("--dry-run", is_flag=True, help="print the effective SplitServeCluster document and exit")
@click.option("--autoscale", is_flag=True,
              help="set autoscaling.mode to slo: the SLO autoscaler starts and drains workers here, within each "
                   "role's minReplicas..maxReplicas")
@click.option("--autoscale-profile", type=click.Path(dir_okay=False, exists=True), default=None,
              help="the replica profile the autoscaler sizes pools with (`splitserve simulate --calibrate` writes "
                   "one) [default: the committed CPU or GPU calibration]")
@config_command(UP_FLAGS, file_option="--file")
def up(resource: ClusterResource, host: str, dry_run: bool, autoscale: bool, autoscale_profile: str | None) -> None:
    """Start the gateway plus prefill and decode workers as local processes; Ctrl-C stops them all."""
    from splitserve.hosts.local.launcher import check_fixed_ports, run

    if autoscale:
        resource.spec.autoscaling.mode = "slo"
    if dry_run:
        from splitserve.common.config_file import dump

        click.echo(dump(resource), nl=False)
        return
    from splitserve.common.proc import die_with_parent_unless_detached

    die_with_parent_unless_detached()  # a killed script or test run takes its cluster with it (not nohup/setsid)
    try:
        check_fixed_ports(resource, host)  # before any worker loads a model
    except ValueError as e:
        fail(str(e))
    setup_logging()
    _prepare(resource)
    sys.exit(run(resource, host, autoscale_profile))


# -- the same cluster on Ray Serve ------------------------------------------------------------------------
# Serve's settings for our traffic, read by every Ray process as it imports Serve (deploy/ray/rayservice.yaml's pods
# carry the same): user code on the replica's own event loop, the handle's router on the caller's, handles over gRPC,
# and the garbage collector frozen after start-up (RAY_SERVE_THROUGHPUT_OPTIMIZED), with Serve's proxy kept on our
# port (direct ingress off). On 2 CPUs they took serve-ray's TTFT p50 from 1.48x to 1.11x of `up`'s, and ITL p50
# from 1.27x to 1.03x (benchmarks/results/serving_ray_cpu2.md).
RAY_SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
RAY_FLAGS = [*UP_FLAGS, flag("max-prefill", "prefill.max_replicas"), flag("max-decode", "decode.max_replicas")]


@app.command("serve-ray")
@click.option("--address", default=None,
              help="a Ray cluster to deploy on (e.g. ray://head:10001 or auto) [default: start a local Ray]")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="local Ray: the node's address, where Serve's HTTP proxy and every replica bind")
@click.option("--num-cpus", type=int, default=None, help="local Ray: CPUs it offers [default: this machine's]")
@click.option("--autoscale", is_flag=True,
              help="set autoscaling.mode to slo: the control law is the application's autoscaling policy")
@click.option("--autoscale-profile", default=None,
              help="the replica profile the law sizes pools with [default: the committed CPU or GPU calibration]")
@click.option("--print-config", is_flag=True,
              help="print the Serve config (for `serve deploy` or a RayService's serveConfigV2) and exit")
@config_command(RAY_FLAGS, file_option="--file")
def serve_ray(resource: ClusterResource, address: str | None, host: str, num_cpus: int | None, autoscale: bool,
              autoscale_profile: str | None, print_config: bool) -> None:
    """Run the cluster as a Ray Serve application (local Ray, or --address); Ctrl-C or SIGTERM takes it down."""
    if autoscale:
        resource.spec.autoscaling.mode = "slo"
    if address is None:  # read when Ray is imported: a local Ray keeps the address it is given (no 127.0.0.1
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # rewritten to the host's address)
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")  # SIGTERM is ours: a clean shutdown
    for name, value in RAY_SERVE_ENV.items():  # a local Ray's processes inherit them (a cluster's own: docs/ray.md)
        os.environ.setdefault(name, value)
    try:
        from splitserve.hosts.ray import app as ray_app
    except ImportError:
        fail("serve-ray needs Ray Serve: pip install 'splitserve[ray]'")
    if print_config:
        import yaml

        click.echo(yaml.safe_dump(ray_app.serve_config(resource, host, profile=autoscale_profile), sort_keys=False),
                   nl=False)
        return
    setup_logging()
    _prepare(resource)
    sys.exit(ray_app.run(resource, host, address, num_cpus, autoscale_profile))


# -- configuration ----------------------------------------------------------------------------------------
@app.command("schema")
def schema() -> None:
    """Print the JSON Schema of a SplitServeCluster document (its `spec` is the configuration model)."""
    from splitserve.common.config_file import schema_json

    click.echo(schema_json())


# -- load testing -----------------------------------------------------------------------------------------
@app.command("bench")
@click.option("-f", "--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="a SplitServeCluster file: the URL (its router port on 127.0.0.1), model and SLO default to its own")
@click.option("--url", default=None, help="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
@click.option("--model", default=None, help="model name to request [default: the file's, else smollm2]")
@click.option("--num-requests", type=int, default=32, show_default=True, help="requests to send")
@click.option("--rate", type=float, default=1.0, show_default=True, help="Poisson arrival rate, requests/s (0: all at once)")
@click.option("--trace", default=None, help="replay a trace: Mooncake .jsonl or Azure .csv")
@click.option("--time-scale", type=float, default=1.0, show_default=True, help="multiply trace inter-arrival times by this")
@click.option("--input-len", type=int, default=256, show_default=True, help="prompt tokens (Poisson mode)")
@click.option("--output-len", type=int, default=32, show_default=True, help="output tokens (Poisson mode)")
@click.option("--max-input-len", type=int, default=4096, show_default=True, help="clip trace prompt lengths")
@click.option("--max-output-len", type=int, default=512, show_default=True, help="clip trace output lengths")
@click.option("--vocab-low", type=int, default=1000, show_default=True, help="lowest token id used in synthetic prompts")
@click.option("--vocab-high", type=int, default=30000, show_default=True,
              help="highest token id (exclusive) in synthetic prompts")
@click.option("--slo-ttft", type=float, default=None,
              help="TTFT SLO in seconds (goodput) [default: the file's slo.ttftSeconds, else 2]")
@click.option("--slo-itl", type=float, default=None,
              help="p99 inter-token latency SLO per request, seconds [default: the file's slo.itlSeconds, else 0.2]")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="per-request timeout, seconds")
@click.option("--max-failure-rate", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="fraction of requests that may fail; above it the run exits 1 (after its report)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="end with one JSON line")
@click.option("--plot", "plot_path", default=None, help="write latency CDFs to this PNG")
@click.option("--progress/--no-progress", default=True, help="progress bar on stderr")
def bench(config_path: str | None, url: str | None, model: str | None, num_requests: int, rate: float,
          trace: str | None, time_scale: float, input_len: int, output_len: int, max_input_len: int,
          max_output_len: int, vocab_low: int, vocab_high: int, slo_ttft: float | None, slo_itl: float | None,
          timeout: float, max_failure_rate: float, seed: int, as_json: bool, plot_path: str | None,
          progress: bool) -> None:
    """Load-test an OpenAI-compatible URL (Poisson arrivals or a trace replay). With -f, the cluster that file
    describes, judged by its own objectives."""
    import asyncio

    from splitserve import bench as b

    setup_logging("warning")
    url, model, slo_ttft, slo_itl = _bench_target(config_path, url, model, slo_ttft, slo_itl)
    if num_requests < 1 or rate < 0 or not 0 <= vocab_low < vocab_high:
        fail("num-requests must be >= 1, rate >= 0 and vocab-low < vocab-high")
    vocab = (vocab_low, vocab_high)
    if plot_path:
        try:
            b.check_plot(plot_path)
        except RuntimeError as e:
            fail(str(e))
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
            click.echo(f"splitserve: error: {e}", err=True)
    if as_json:
        print(json.dumps(summary))
    problem = b.failure_problem(summary, max_failure_rate)
    if problem:
        sys.stdout.flush()
        fail(problem, code=1)


def _bench_target(config_path: str | None, url: str | None, model: str | None, slo_ttft: float | None,
                  slo_itl: float | None) -> tuple[str, str, float, float]:
    """URL, model and SLO for `bench`: each flag given, else the cluster file's, else the built-in default."""
    from splitserve.common.config_file import ConfigError, load

    if config_path is None:
        if url is None:
            fail("give --url (or -f, a cluster file whose router it measures)")
        return url, model or "smollm2", 2.0 if slo_ttft is None else slo_ttft, 0.2 if slo_itl is None else slo_itl
    try:
        spec = load(config_path).spec
    except ConfigError as e:
        fail(str(e))
    return (url or f"http://127.0.0.1:{spec.router.port}", model or spec.model.served_name,
            spec.slo.ttft_seconds if slo_ttft is None else slo_ttft, spec.slo.itl_seconds if slo_itl is None else slo_itl)


# -- operating a running cluster --------------------------------------------------------------------------
@app.command("flip")
@click.option("--url", required=True, help="the gateway's base URL, e.g. http://127.0.0.1:8000")
@click.option("--worker", required=True, help="the worker's name, as the gateway's /health lists it")
@click.option("--to", "role", type=click.Choice(["prefill", "decode"]), required=True, help="the role it is to serve")
@click.option("--drain-seconds", type=click.FloatRange(0, 3600), default=FLIP_DRAIN_SECONDS, show_default=True,
              help="how long its requests may finish before its streams move to other decode workers (a prefill "
                   "worker's prefills always finish)")
@click.option("--timeout", type=click.FloatRange(0, 3600, min_open=True), default=FLIP_TIMEOUT_SECONDS,
              show_default=True, help="seconds to wait for the worker to serve its new role")
@click.option("--api-key", envvar="SPLITSERVE_API_KEY", default=None,
              help="the gateway's API key, when it asks for one [env: SPLITSERVE_API_KEY]")
def flip(url: str, worker: str, role: str, drain_seconds: float, timeout: float, api_key: str | None) -> None:
    """Move a worker to the other role without a restart: it stops taking its role's work, lets it finish (its
    streams still running after --drain-seconds move to other decode workers), and registers under the new
    role. Exits 0 once the gateway sees it serving, printing the seconds it took."""
    import urllib.error
    import urllib.request

    body = json.dumps({"worker": worker, "role": role, "drain_seconds": drain_seconds,
                       "timeout_seconds": timeout}).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    req = urllib.request.Request(url.rstrip("/") + "/admin/flip", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout + 10) as r:  # noqa: S310 (the URL the operator gave)
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        fail(_error_message(e), code=1)
    except (urllib.error.URLError, OSError) as e:  # refused, unreachable, or no answer in time
        fail(f"--url: no answer from the gateway at {url} ({getattr(e, 'reason', e)})", code=1)
    except ValueError:
        fail(f"--url: {url} did not answer as a splitserve gateway (not JSON)", code=1)
    click.echo(f"worker {answer['worker']} serves {answer['to']} (was {answer['from']}) after {answer['seconds']:.2f} s; "
               f"{answer['moved_streams']} streams moved")


def _error_message(e) -> str:
    """The gateway's error message from an HTTP error answer (OpenAI-shaped JSON), else its status."""
    try:
        return json.loads(e.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"the gateway answered {e.code} {e.reason}"


# -- commands that live in their own modules: Kubernetes, the autoscaling simulator -----------------------
app.add_command(operator)
app.add_command(crd)
app.add_command(render)
app.add_command(simulate)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
