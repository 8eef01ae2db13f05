"""`splitserve up`: the gateway plus prefill and decode workers as local processes on this machine.

Waits until every component is ready, prints the URL (a line containing `ready`) and a curl example, and on
Ctrl-C or SIGTERM stops everything. Children die with the launcher even if it is killed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

log = logging.getLogger("splitserve.launcher")


@dataclass
class LaunchConfig:
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    mode: str = "disaggregated"
    model: str = "smollm2"
    host: str = "127.0.0.1"
    kv_transport: str = "auto"
    disagg_threshold: int = 512
    kv_cache_memory: str = "auto"
    served_model_name: str = "smollm2"
    ready_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be disaggregated or colocated, got {self.mode!r}")
        if self.num_decode < 1:
            raise ValueError("decode: at least one worker")
        if self.mode == "disaggregated" and self.num_prefill < 1:
            raise ValueError("prefill: disaggregated mode needs at least one prefill worker")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1-65535, got {self.port}")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn for children: SIGTERM when the parent dies (Linux)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Launcher:
    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self._reported: set[str] = set()
        self.components: dict = {"router": f"http://{cfg.host}:{cfg.port}", "prefill": [], "decode": []}

    def _spawn(self, name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "splitserve.cli", *args]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        self.procs.append((name, proc))

    def start(self) -> None:
        cfg = self.cfg
        colocated = cfg.mode == "colocated"
        n_workers = cfg.num_decode + (0 if colocated else cfg.num_prefill)
        threads = max(1, (os.cpu_count() or 1) // n_workers)
        common = ["--model", cfg.model, "--host", cfg.host, "--kv-cache-memory", cfg.kv_cache_memory,
                  "--threads", str(threads), "--served-model-name", cfg.served_model_name]
        prefill_eps = []
        if not colocated:
            for i in range(cfg.num_prefill):
                port, mport = free_port(cfg.host), free_port(cfg.host)
                ep = f"{cfg.host}:{port}"
                prefill_eps.append(ep)
                self.components["prefill"].append({"grpc": ep, "metrics": f"http://{cfg.host}:{mport}"})
                self._spawn(f"prefill-{i}", ["prefill", "--port", str(port), "--metrics-port", str(mport),
                                             "--kv-transport", cfg.kv_transport, *common])
        decode_eps = []
        for i in range(cfg.num_decode):
            port, mport = free_port(cfg.host), free_port(cfg.host)
            ep = f"{cfg.host}:{port}"
            decode_eps.append(ep)
            self.components["decode"].append({"grpc": ep, "metrics": f"http://{cfg.host}:{mport}"})
            if colocated:
                args = ["worker", "--role", "both", "--port", str(port), "--metrics-port", str(mport), *common]
            else:
                args = ["decode", "--port", str(port), "--metrics-port", str(mport), "--kv-transport", cfg.kv_transport,
                        "--prefill-peers", ",".join(prefill_eps), "--disagg-threshold", str(cfg.disagg_threshold),
                        *common]
            self._spawn(f"decode-{i}", args)
        router_args = ["router", "--decode", ",".join(decode_eps), "--port", str(cfg.port), "--host", cfg.host,
                       "--model", cfg.model, "--served-model-name", cfg.served_model_name]
        if prefill_eps:
            router_args += ["--prefill", ",".join(prefill_eps)]
        self._spawn("router", router_args)

    def dead(self, fatal_only: bool = False) -> str | None:
        """A component that exited; with fatal_only, only the router or the last decode worker counts (the
        gateway routes around a dead prefill worker or a dead decode worker while another one lives)."""
        decode = [p for name, p in self.procs if name.startswith("decode")]
        for name, p in self.procs:
            if p.poll() is None:
                continue
            if not fatal_only or name == "router" or all(d.poll() is not None for d in decode):
                return f"{name} exited with code {p.returncode}"
            if name not in self._reported:
                self._reported.add(name)
                log.warning("%s exited with code %s; still serving", name, p.returncode)
        return None

    def wait_ready(self, stop: list[bool]) -> bool:
        url = f"http://{self.cfg.host}:{self.cfg.port}/health"
        deadline = time.monotonic() + self.cfg.ready_timeout
        while time.monotonic() < deadline and not stop[0]:
            problem = self.dead()
            if problem:
                log.error("startup failed: %s", problem)
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if json.loads(r.read()).get("all_healthy"):
                        return True
            except OSError:
                pass
            except ValueError:
                pass
            time.sleep(0.5)
        if not stop[0]:
            log.error("startup timed out after %.0f s", self.cfg.ready_timeout)
        return False

    def stop(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def run(cfg: LaunchConfig) -> int:
    launcher = Launcher(cfg)
    stop = [False]

    def on_signal(signum, frame) -> None:
        stop[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    launcher.start()
    code = 0
    try:
        if not launcher.wait_ready(stop):
            return 0 if stop[0] else 1
        base = f"http://{cfg.host}:{cfg.port}"
        n_pre = 0 if cfg.mode == "colocated" else cfg.num_prefill
        print(f"splitserve ready: {base}/v1 (model {cfg.served_model_name}, {cfg.mode}: {n_pre} prefill + "
              f"{cfg.num_decode} decode)", flush=True)
        print(f"splitserve components {json.dumps(launcher.components)}", flush=True)
        print(f"try: curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{cfg.served_model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
              flush=True)
        while not stop[0]:
            problem = launcher.dead(fatal_only=True)
            if problem:
                log.error("stopping: %s", problem)
                code = 1
                break
            time.sleep(0.3)
    finally:
        launcher.stop()
        log.info("all components stopped")
    return code
