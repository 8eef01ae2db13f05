"""`splitserve bench` against a tiny local OpenAI-shaped server that fails some requests on purpose: a run with
more failures than --max-failure-rate exits non-zero with one line (after its report), and plots say how many
failed requests they leave out. The README's trace example reads a sample the repository carries."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support.metrics_server import serve_locally, stop

from splitserve import bench as b

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent / "splitserve"


class FlakyServer:
    """Streams 3 completion tokens per request, except every `fail_every`-th request, which gets HTTP 500."""

    def __init__(self, fail_every: int) -> None:
        count = [0]
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    count[0] += 1
                    n = count[0]
                if n % fail_every == 0:
                    body = b'{"error": {"message": "injected failure", "type": "server_error"}}'
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("a", "b", "c")]
                chunks.append({"choices": [], "usage": {"completion_tokens": 3}})
                data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

            def log_message(self, *_: object) -> None:
                pass

        self.server, self.url = serve_locally(Handler)

    def close(self) -> None:
        stop(self.server)


@pytest.fixture
def flaky():
    server = FlakyServer(fail_every=4)  # 2 of 8 requests fail
    yield server
    server.close()


def bench(url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), "bench", "--url", url, "--rate", "0", "--num-requests", "8", "--input-len", "8",
                           "--output-len", "3", "--no-progress", "--json", *extra],
                          capture_output=True, text=True, timeout=120)


def test_failures_over_the_allowed_rate_fail_the_run_in_one_line(flaky):
    res = bench(flaky.url)  # default: no failure allowed
    assert res.returncode == 1, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])  # the report and its JSON line still come
    assert (summary["completed"], summary["failed"]) == (6, 2)
    [line] = res.stderr.strip().splitlines()
    assert line.startswith("splitserve: error: 2 of 8 requests failed (25.0% > --max-failure-rate 0)")
    assert "HTTP 500" in line and "Traceback" not in res.stderr
    assert bench(flaky.url, "--max-failure-rate", "0.2").returncode == 1
    assert bench(flaky.url, "--max-failure-rate", "0.25").returncode == 0


def test_a_bad_failure_rate_is_one_line(flaky):
    res = bench(flaky.url, "--max-failure-rate", "2")
    assert res.returncode == 2 and "--max-failure-rate" in res.stderr and res.stderr.count("\n") == 1


def test_plots_say_how_many_failed_requests_they_leave_out(tmp_path):
    results = [b.Result(ok=True, ttft=0.1, itls=[0.01, 0.02], e2e=0.2, output_tokens=3)] * 5 + \
        [b.Result(ok=False, error="HTTP 500")] * 14
    assert b.plot_title(results) == "5 completed requests; 14 failed requests not shown"
    assert b.plot_title(results[:5]) == "5 completed requests"
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    seen = []
    real = plt.Figure.savefig

    def savefig(fig, *args, **kw):
        seen.append(fig._suptitle.get_text())
        return real(fig, *args, **kw)

    plt.Figure.savefig = savefig
    try:
        b.plot(results, str(tmp_path / "cdf.png"))
    finally:
        plt.Figure.savefig = real
    assert seen == ["5 completed requests; 14 failed requests not shown"]


def test_the_readme_trace_example_reads_a_sample_in_the_repository():
    from e2e.test_cli import readme_commands

    traces = [c for c in readme_commands() if c[0] == "bench" and "--trace" in c]
    assert traces, "README lost its trace example"
    for cmd in traces:
        path = ROOT / cmd[cmd.index("--trace") + 1]
        assert path.is_file() and path.is_relative_to(ROOT / "benchmarks" / "traces"), path
        n = int(cmd[cmd.index("--num-requests") + 1])
        assert len(b.load_trace(str(path), n, 1.0, 1024, 32, (1000, 30000), 0)) == n


def test_bench_without_a_target_or_with_a_bad_cluster_file_is_one_line(tmp_path):
    bad = tmp_path / "cluster.yaml"
    bad.write_text("apiVersion: splitserve.dev/v1alpha1\nkind: SplitServeCluster\nmetadata: {name: x}\n"
                   "spec: {slo: {ttftSeconds: -1}}\n")
    for args, names in (([], "--url"), (["-f", str(tmp_path / "missing.yaml")], "missing.yaml"),
                        (["-f", str(bad)], "slo.ttftSeconds")):
        res = subprocess.run([str(BIN), "bench", *args, "--num-requests", "1"], capture_output=True, text=True,
                             timeout=60)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and names in lines[0], lines
