"""Process helpers shared by the launcher, the tensor-parallel ranks, the benchmarks and the tests: free ports,
children that die with their parent (Linux PR_SET_PDEATHSIG), and children spoken to in JSON lines that are
watched while we wait."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque


def python_module(module: str) -> list[str]:
    """The command line that runs `module` of the installed splitserve in this interpreter. `-P` keeps the
    working directory off `sys.path`: run from a checkout, its source folder `./splitserve` would otherwise
    shadow the installed package (and lacks the subpackages installed from the other top-level folders)."""
    return [sys.executable, "-P", "-m", module]


def splitserve_command() -> list[str]:
    """The installed `splitserve` entry point, as children of every host start it: the console script beside
    this interpreter (a virtualenv's or an image's bin/), else the CLI module run as `python_module` does."""
    script = os.path.join(os.path.dirname(sys.executable), "splitserve")
    return [script] if os.access(script, os.X_OK) else python_module("splitserve.cli")


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity: a container's cpuset, `taskset`, a CI runner's share),
    which the machine's count (`os.cpu_count`) overstates where any of those applies."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports. Each pick is held bound until all are picked: picks closed one by one can return
    the same port twice (a port is free until its process binds it), and two processes given one port leave
    one unable to listen."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def die_with_parent() -> None:
    """preexec_fn for children: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def die_with(parent_pid: int) -> None:
    """The child's own half of `die_with_parent`, for children of a process with threads (a gRPC server): there
    no Python may run between fork and exec, so no preexec_fn. SIGTERM when the parent dies; exit at once if it
    already has."""
    die_with_parent()
    if os.getppid() != parent_pid:
        raise SystemExit(f"parent {parent_pid} is gone")


def dying_with_me(cmd: list[str]) -> list[str]:
    """`cmd` behind a small exec shim (`python -m splitserve.common.proc`) that sets the child's parent-death
    signal itself (SIGTERM when this process, more exactly the calling thread, dies; even by SIGKILL), then
    execs `cmd`; the signal survives the exec. Unlike a preexec_fn, nothing runs between fork and exec here, so
    it is safe from a process with threads (the autoscaler's, gRPC's fork handlers) and works for any
    program (redis-server)."""
    return [*python_module("splitserve.common.proc"), "--die-with", str(os.getpid()), "--", *cmd]


def leading_group(cmd: list[str], grace_s: float, cores: list[int] | None = None) -> list[str]:
    """`cmd` behind a shim that stays to lead its process group, for a program that owns a tree of processes and
    may not stop on SIGTERM while it starts (a vLLM server: its engine cores, its model load). Start the result
    as its own session (`start_new_session=True`). The shim (`python -m splitserve.common.proc --group`) runs `cmd`
    as its child in its group, pinned to `cores` if given, and exits with its exit status. When this process
    dies (even by SIGKILL) or the shim is sent SIGTERM, the whole group gets SIGTERM, and whatever of it is left
    after `grace_s` seconds gets SIGKILL."""
    pinned = ["--cores", ",".join(map(str, cores))] if cores else []
    return [*python_module("splitserve.common.proc"), "--die-with", str(os.getpid()), "--group", f"{grace_s:g}",
            *pinned, "--", *cmd]


def die_with_parent_unless_detached() -> bool:
    """For a command that owns a tree of processes (`splitserve up`): SIGTERM when whatever started it dies
    (a killed test run, script or terminal leaves nothing behind), except when it was started detached on
    purpose: under nohup (SIGHUP ignored) or as its own session leader (setsid). True when set."""
    if not sys.platform.startswith("linux"):
        return False
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN or os.getsid(0) == os.getpid():
        return False
    die_with(os.getppid())  # exits at once if the parent died before the signal was set
    return True


class ChildDied(RuntimeError):
    """A watched child process exited (or closed its output) while we waited on it."""


class JsonLinesChild:
    """A child process spoken to in JSON lines (commands on its stdin, one reply per line on its stdout), watched
    whenever we wait on it: a child that dies, at start or later, raises `ChildDied` within `check_s`, naming its
    exit code and its last stderr lines, instead of leaving the caller to an outer timeout."""

    def __init__(self, cmd: list[str], what: str, echo_stderr: bool = False, check_s: float = 0.1) -> None:
        self.what = what
        self.check_s = check_s
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                     preexec_fn=die_with_parent)
        self._lines: queue.Queue[str | None] = queue.Queue()  # None: its stdout closed
        self._stderr_tail: deque[str] = deque(maxlen=20)
        self._echo = echo_stderr
        threading.Thread(target=self._read_stdout, name=f"{what}-stdout", daemon=True).start()
        self._stderr_pump = threading.Thread(target=self._read_stderr, name=f"{what}-stderr", daemon=True)
        self._stderr_pump.start()

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._stderr_tail.append(line.rstrip("\n"))
            if self._echo:
                sys.stderr.write(line)

    def send_json(self, msg: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self.died() from None

    def recv_json(self, timeout: float) -> dict:
        """The next reply; ChildDied once the process is gone, TimeoutError after `timeout` seconds of silence."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=self.check_s)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise self.died() from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.what} (pid {self.proc.pid}) silent for {timeout:.0f} s") from None
                continue
            if line is None:
                raise self.died()
            return json.loads(line)

    def died(self) -> ChildDied:
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None  # closed its stdout but lingers
        self._stderr_pump.join(2)  # its last words
        tail = "\n".join(self._stderr_tail) or "(nothing on stderr)"
        return ChildDied(f"{self.what} process (pid {self.proc.pid}) exited with code {code}; "
                         f"last stderr lines:\n{tail}")


_USAGE = "usage: python -m splitserve.common.proc --die-with PID [--group GRACE_S [--cores N,N]] -- CMD [ARGS...]"


def _exec_main(argv: list[str]) -> None:
    """`python -m splitserve.common.proc --die-with PID [--group GRACE_S [--cores N,...]] -- CMD...`: the child
    half of `dying_with_me` (exec CMD) or of `leading_group` (run CMD in this process's group)."""
    if "--" not in argv or len(argv) < 4 or argv[0] != "--die-with":
        raise SystemExit(_USAGE)
    at = argv.index("--")
    opts, cmd = argv[2:at], argv[at + 1:]
    if not cmd or (opts and (opts[0] != "--group" or len(opts) not in (2, 4) or (len(opts) == 4 and opts[2] != "--cores"))):
        raise SystemExit(_USAGE)
    if not opts:
        die_with(int(argv[1]))
        os.execvp(cmd[0], cmd)
    cores = [int(c) for c in opts[3].split(",")] if len(opts) == 4 else None
    raise SystemExit(_lead_group(int(argv[1]), cmd, float(opts[1]), cores))


def _lead_group(parent_pid: int, cmd: list[str], grace_s: float, cores: list[int] | None) -> int:
    """Run `cmd` as a child in this process's group; on SIGTERM (sent to the group by its owner, or this shim's
    parent-death signal) stop the group: SIGTERM, then SIGKILL after `grace_s`. Returns `cmd`'s exit status (a
    signal's as 128 + its number, as a shell does)."""
    if os.getpgid(0) != os.getpid():
        raise SystemExit("--group: start this shim as its own session or process group (start_new_session=True)")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # before the parent-death signal is armed
    die_with(parent_pid)
    if cores:
        os.sched_setaffinity(0, cores)  # the child and every thread and process it starts inherit it
    child = subprocess.Popen(cmd)
    while child.poll() is None and not stop.wait(0.2):
        pass
    if child.poll() is None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(0, signal.SIGTERM)  # the child's own children too (the owner's SIGTERM may not have reached them)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(grace_s)
    _kill_group_but_me()  # anything left: a child that ignored SIGTERM, or its children once it exited
    code = child.wait()
    return code if code >= 0 else 128 - code


def group_members(pgid: int) -> list[int]:
    """The pids of process group `pgid` now (Linux: read from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry)) == pgid:
                    members.append(int(entry))
    return members


def _kill_group_but_me() -> None:
    me = os.getpid()
    for pid in group_members(me):
        if pid != me:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    _exec_main(sys.argv[1:])
