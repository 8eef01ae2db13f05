"""Run `splitserve up` as a real process group for the serving tests."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from splitserve.common.proc import free_port
from support.procs import children, module_of

PORT_ATTEMPTS = 3  # starts of `up` whose gateway port was taken before it bound it


class Up:
    """`splitserve up ARGS` until it says ready; `exe`: another install's entry point (this venv's by default),
    run in `cwd`."""

    def __init__(self, *args: str, timeout: float = 240.0, exe: Path | None = None, cwd: Path | None = None) -> None:
        exe = exe or Path(sys.executable).parent / "splitserve"
        # the gateway's port is picked free here and bound by `up` seconds later; another test process may take it
        # in between (seen once in a full run), so a start that fails on exactly that is made again on another
        for attempt in range(PORT_ATTEMPTS):
            if self._start(exe, cwd, args, timeout):
                return
            self.stop()
            taken = any("already in use" in line and str(self.port) in line for line in self.stderr)
            if not taken or attempt == PORT_ATTEMPTS - 1:
                raise RuntimeError("splitserve up did not become ready:\n" + "".join(self.stderr[-30:]))

    def _start(self, exe: Path, cwd: Path | None, args: tuple[str, ...], timeout: float) -> bool:
        """Start `up` on a free port; True once it printed its components."""
        self.port = free_port()
        self.proc = subprocess.Popen([str(exe), "up", "--port", str(self.port), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=cwd)
        self.stderr: list[str] = []
        self.stdout: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        self.components: dict = {}
        deadline = time.monotonic() + timeout
        ready = False
        while time.monotonic() < deadline:
            try:
                line = self.stdout.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            if "ready" in line:
                ready = True
            m = re.match(r"splitserve components (.*)", line)
            if m:
                self.components = json.loads(m.group(1))
                break
        return ready and bool(self.components)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout.put(line)
        self.stdout.put(None)

    def metrics(self, role: str, index: int = 0) -> dict[str, float]:
        """A worker's /metrics as {'name{labels}': value}."""
        return scrape(self.components[role][index]["metrics"])

    def stats(self, role: str, index: int = 0) -> dict:
        with urllib.request.urlopen(self.components[role][index]["metrics"] + "/stats", timeout=10) as r:
            return json.loads(r.read())

    @contextmanager
    def explained(self, lines: int = 60) -> Iterator[None]:
        """A failure inside prints the cluster's last warning and error log lines (pytest shows a failed test's
        output): what its gateway and workers saw, for a failure that only a busy machine brings out."""
        try:
            yield
        except BaseException:
            print("".join([line for line in self.stderr if re.search(r'"level": "(warning|error)"', line)][-lines:]))
            raise

    def stop(self) -> int:
        """SIGTERM; `up` stops its workers within their drain period (120 s by default) and then Redis. Past that
        it is killed and the failure shows its last log lines (who it was still waiting for)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(150)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError("splitserve up did not stop 150 s after SIGTERM:\n"
                                     + "".join(self.stderr[-20:])) from None
        return self.proc.returncode


def scrape(url: str) -> dict[str, float]:
    """`url`/metrics (a worker, a gateway, the autoscaler) as {'name{labels}': value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def vllm_server_of(worker_pid: int) -> tuple[int, list[str]]:
    """The vLLM server a worker (engine vllm) started: (its pid, its command line). It runs under a shim, the
    worker's child, that leads its process group: `os.killpg(os.getpgid(pid), ...)` reaches the server, its
    engine-core processes and the shim."""
    shims = {p for p in children(worker_pid) if module_of(p) == "splitserve.common.proc"}
    for shim in shims:
        for pid in children(shim):
            if module_of(pid) == "vllm.entrypoints.openai.api_server":
                return pid, Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    raise AssertionError(f"worker {worker_pid} has no vLLM server")

