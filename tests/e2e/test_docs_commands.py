"""Every fenced shell command in README.md and docs/ runs or is checked here, against this checkout as a fresh
clone has it: `make` targets exist, `splitserve` command lines parse with the CLI itself and name files that
exist (the `simulate` examples run), benchmark scripts accept their arguments, `curl` calls name a gateway route
with a valid JSON body, and nothing asks for a package that is not published (`pip install splitserve`).
docs/kubernetes.md and docs/ray.md have their own tests, which carry out each of their commands with Helm's
library, the CRDs and Ray's schema (tests/e2e/test_k8s_docs.py, tests/e2e/test_ray_docs.py).

A command with no rule here fails: a new kind of example needs a way to be checked."""

from __future__ import annotations

import argparse
import json
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

from splitserve.cli import app

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
OWN_TESTS = {"docs/kubernetes.md": "tests/e2e/test_k8s_docs.py", "docs/ray.md": "tests/e2e/test_ray_docs.py"}
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
GATEWAY_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json"}


def fenced_commands(doc: str) -> list[list[str]]:
    """Each command of the doc's sh/bash/console blocks, continuation lines joined and comments dropped."""
    text = (ROOT / doc).read_text()
    out = []
    for block in re.findall(r"^```(?:sh|bash|shell|console)\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def _cli_context(argv: list[str]) -> click.Context:
    """`splitserve ARGV` parsed as the CLI parses it (types, choices, required options, files that must exist),
    without running the command."""
    ctx = click.Context(app, info_name="splitserve")
    command = app.get_command(ctx, argv[0])
    assert command is not None, f"no such command: {argv[0]}"
    return command.make_context(argv[0], list(argv[1:]), parent=ctx)


def _paths(argv: list[str]) -> list[str]:
    """Arguments that name a file or folder (relative ones: the checkout's, as a clone has them)."""
    return [a for a in argv if "/" in a and not re.match(r"^[a-z]+://", a) and not a.startswith("-")]


def check_splitserve(argv: list[str], tmp_path: Path) -> None:
    args = argv[1:]
    out_file = None
    if ">" in args:
        out_file = args[args.index(">") + 1]
        args = args[:args.index(">")]
    for path in _paths(args):
        inside = (ROOT / path).resolve().is_relative_to(ROOT)
        assert inside and (ROOT / path).exists(), f"{' '.join(argv)}: {path} is not in the checkout"
    _cli_context(args)
    if args[0] == "simulate":  # cheap on the bundled samples: run it, plots into a scratch folder
        if "--plot" in args:
            args[args.index("--plot") + 1] = str(tmp_path / "plot.png")
        res = subprocess.run([str(Path(sys.executable).parent / "splitserve"), *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, f"{' '.join(argv)}\n{res.stderr[-2000:]}"
        if "--json" in args:
            assert "slo_attainment" in json.loads(res.stdout.strip().splitlines()[-1])
    assert out_file is None or not Path(out_file).is_absolute()


ACCEPTED = SystemExit(0)


def check_benchmark_script(argv: list[str]) -> None:
    """`.venv/bin/python benchmarks/X.py ARGS`: the script's own argument parser accepts ARGS (it is stopped right
    after parsing, before any work)."""
    script = ROOT / argv[1]
    assert script.is_file(), argv
    parsed: list[argparse.Namespace] = []
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        parsed.append(original(self, args, namespace))
        raise ACCEPTED

    saved = sys.argv, sys.path
    argparse.ArgumentParser.parse_args = parse_and_stop  # type: ignore[method-assign]
    sys.argv = [str(script), *argv[2:]]
    sys.path = [str(script.parent), *sys.path]  # as `python X.py` has it: the script's folder first (its harness)
    try:
        with pytest.raises(SystemExit) as stopped:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv, sys.path = saved
    assert stopped.value is ACCEPTED and parsed, f"{' '.join(argv)}: its arguments were refused"


def check_curl(argv: list[str]) -> None:
    url = next(a for a in argv[1:] if a.startswith("http"))
    path = re.sub(r"^https?://[^/]+", "", url)
    assert path in GATEWAY_ROUTES, f"{url}: not a gateway route"
    if "-d" in argv:
        body = json.loads(argv[argv.index("-d") + 1])
        assert body["model"] == "smollm2"
        assert "Content-Type: application/json" in argv


def check_make(argv: list[str]) -> None:
    targets = argv[1:]
    assert targets, argv
    dry = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr


def check(argv: list[str], tmp_path: Path) -> None:
    program = argv[0]
    if program in ("splitserve", ".venv/bin/splitserve"):
        check_splitserve(argv, tmp_path)
    elif program == ".venv/bin/python" and argv[1].startswith("benchmarks/"):
        check_benchmark_script(argv)
    elif program == "curl":
        check_curl(argv)
    elif program == "make":
        check_make(argv)
    elif program.endswith("pip") and argv[1] == "install":
        assert "-e" in argv and argv[argv.index("-e") + 1].startswith(".["), \
            f"{' '.join(argv)}: splitserve is installed from the checkout, not from an index"
    else:
        raise AssertionError(f"no rule checks this documented command: {' '.join(argv)}")


@pytest.mark.parametrize("doc", DOCS)
def test_every_fenced_command_runs_or_is_checked(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # relative paths as a clone's README means them
    commands = fenced_commands(doc)
    if doc in OWN_TESTS:
        assert (ROOT / OWN_TESTS[doc]).is_file()
        return
    for argv in commands:
        check(argv, tmp_path)


def test_the_rules_refuse_what_would_fail_in_a_clone(tmp_path, monkeypatch):
    """Each rule fails on the mistakes the docs have made: a trace outside the checkout, an unknown flag, an
    unpublished package, a script argument the script refuses, a route the gateway lacks."""
    bad = [
        [".venv/bin/splitserve", "simulate", "--trace", "../shared/traces/azure_conv_2023.csv"],
        [".venv/bin/splitserve", "bench", "-f", "deploy/examples/nope.yaml"],
        [".venv/bin/splitserve", "up", "--frobnicate"],
        ["pip", "install", "splitserve[ray]"],
        [".venv/bin/python", "benchmarks/engine_throughput.py", "--no-such-flag"],
        ["curl", "http://127.0.0.1:8000/v1/chat"],
        ["make", "no-such-target"],
        ["helm", "upgrade"],
    ]
    monkeypatch.chdir(ROOT)
    for argv in bad:
        with pytest.raises((AssertionError, click.ClickException, SystemExit)):
            check(argv, tmp_path)
