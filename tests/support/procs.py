"""Processes a test started, read from /proc: a tree of descendants, command lines, liveness, TCP listeners;
and a command whose stdout announces readiness (`splitserve serve-ray`)."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
from pathlib import Path

# 127.0.0.1 in /proc/net/tcp, ::1 and ::ffff:127.0.0.1 in /proc/net/tcp6
LOOPBACK = ("0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return out


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children(p)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def module_of(pid: int) -> str | None:
    """The module a Python process runs (`python [-P] -m MODULE ...`); None for any other process. A vLLM server's
    shim (`python -m splitserve.common.proc ... -- python -m vllm...`) runs splitserve.common.proc, not vLLM."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    return args[args.index("-m") + 1] if "-m" in args[:-1] else None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def listeners(pids: set[int]) -> list[tuple[int, str, str]]:
    """(pid, address hex, command) of every TCP listening socket the processes hold, from /proc/net/tcp{,6}."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    link = os.readlink(fd)
                except OSError:
                    continue
                if link.startswith("socket:["):
                    owner[link[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in owner:
                out.append((owner[f[9]], f[1].split(":")[0], cmdline(owner[f[9]])))
    return out


def reap(pids: set[int], wait_s: float = 30.0) -> list[tuple[int, str]]:
    """Wait for the processes to be gone; SIGKILL what is left (nothing stays behind for the next test) and
    return it."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.5)
    left = [(p, cmdline(p)) for p in pids if alive(p)]
    for p, _ in left:
        os.kill(p, 9)
    return left


class Announcing:
    """A command in its own session whose stdout says when it is ready; stderr is kept."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)  # a SIGTERM goes to it alone
        self.stderr: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def tail(self, n: int = 30) -> str:
        return "".join(self.stderr[-n:])

    def exit_code(self, timeout_s: float) -> int:
        """Its exit code; fails the test with its log's last lines if it is still running after `timeout_s`."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout_s:.0f} s later:\n" + self.tail()) from None

    def wait_for(self, text: str, timeout_s: float) -> str:
        """The first stdout line containing `text`; fails the test if the command exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=1.0)
            except queue.Empty:
                continue
            assert line is not None, f"{self.proc.args[0]} exited:\n" + self.tail()
            if text in line:
                return line
        raise AssertionError(f"no {text!r} after {timeout_s:.0f} s:\n" + self.tail())
