"""Clusters never outlive what started them: `splitserve up` dies with its parent (a killed test run, script or
terminal), and every process it starts (workers, gateways, the bundled Redis) dies with `up`, even when `up` is
killed with SIGKILL. The parent-death signal is set by each child itself (`dying_with_me`), so it holds for
children started from a process with threads."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from splitserve.common.proc import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")]
BIN = Path(sys.executable).parent / "splitserve"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still running after `timeout` seconds (none, once they all exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def test_a_child_started_from_a_threaded_parent_dies_with_it_on_sigkill():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, threading, time
        from splitserve.common.proc import dying_with_me
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # a parent with threads
        child = subprocess.Popen(dying_with_me(["sleep", "600"]))
        print(child.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while alive(child) and not Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep"):
            assert time.monotonic() < deadline, "the shim never exec'd sleep"
            time.sleep(0.02)
        assert alive(child) and Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep")
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone([child], 5) == []
    finally:
        parent.kill()


def start_up_under_a_parent(log: Path) -> tuple[subprocess.Popen, int, dict]:
    """A parent process (a stand-in for a test run or a script) that starts `splitserve up` (a colocated worker,
    a gateway and, for kv_aware routing, a bundled Redis; its log to `log`) and waits; (parent, up's pid, up's
    components)."""
    port = free_port()
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        up = subprocess.Popen([{str(BIN)!r}, "up", "--port", "{port}", "--mode", "colocated", "--decode", "1",
                               "--routing", "kv_aware"], stderr=open({str(log)!r}, "w"))
        print("up-pid", up.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    up_pid, components = 0, {}
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not components:
        line = parent.stdout.readline()
        if not line:
            break
        if line.startswith("up-pid "):
            up_pid = int(line.split()[1])
        elif line.startswith("splitserve components "):
            components = json.loads(line.split(" ", 2)[2])
    if not components:
        parent.kill()
        if up_pid:
            os.kill(up_pid, signal.SIGKILL)
        raise RuntimeError("splitserve up did not become ready")
    return parent, up_pid, components


def read_components(up: subprocess.Popen, stderr: list[str], timeout: float = 240) -> dict:
    """`up`'s components line, once it is ready (else a failure with how `up` ended and its log's last lines)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        if line.startswith("splitserve components "):
            return json.loads(line.split(" ", 2)[2])
    with contextlib.suppress(subprocess.TimeoutExpired):  # stdout closed: it is exiting; else the finally kills it
        up.wait(10)
    raise RuntimeError(f"splitserve up did not become ready (exit code {up.poll()}); its log ends:\n"
                       + "".join(stderr[-30:]))


def tree(components: dict) -> list[int]:
    return [w["pid"] for w in components["decode"]] + [r["pid"] for r in components["routers"]] + \
        [components["redis"]["pid"]]


def test_up_and_everything_it_started_die_when_its_parent_is_killed(tmp_path):
    log = tmp_path / "up.log"
    parent, up_pid, components = start_up_under_a_parent(log)
    pids = [up_pid, *tree(components)]
    try:
        assert all(alive(p) for p in pids) and len(pids) == 4
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_gone(pids, 30) == [], "still running after their parent was killed; up's log ends:\n" + \
            "\n".join(log.read_text().splitlines()[-30:])
    finally:
        parent.kill()
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_what_up_started_dies_when_up_is_killed_with_sigkill(tmp_path):
    parent, up_pid, components = start_up_under_a_parent(tmp_path / "up.log")
    pids = tree(components)
    try:
        os.kill(up_pid, signal.SIGKILL)
        assert wait_gone(pids, 30) == [], "workers, gateway or Redis outlived a SIGKILLed `splitserve up`"
    finally:
        parent.kill()
        for p in [up_pid, *pids]:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_ctrl_c_waits_for_the_drain_and_says_a_second_one_stops_now():
    """Ctrl-C in a terminal signals the whole foreground group: `up` and its workers. With a stream in flight the
    first one says how long the drain may take and that a second Ctrl-C stops now; the second stops everything at
    once, well before the drain period (drainSeconds, 120 s by default) would have ended."""
    import httpx

    port = free_port()
    up = subprocess.Popen([str(BIN), "up", "--mode", "colocated", "--decode", "1", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)  # its own group, as a shell gives a foreground job
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(up.stderr), daemon=True).start()
    try:
        components = read_components(up, stderr)
        pids = [w["pid"] for w in components["decode"]] + [r["pid"] for r in components["routers"]]
        body = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 4000, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # the stream is running
            os.killpg(up.pid, signal.SIGINT)
            deadline = time.monotonic() + 30
            while not any("Ctrl-C again stops now" in line for line in stderr):
                assert time.monotonic() < deadline and up.poll() is None, "".join(stderr[-20:])
                time.sleep(0.1)
            assert up.poll() is None  # still draining: the stream is in flight
            started = time.monotonic()
            os.killpg(up.pid, signal.SIGINT)
            up.wait(30)
        assert time.monotonic() - started < 30
        assert wait_gone(pids, 30) == []
        hint = next(json.loads(line) for line in stderr if "Ctrl-C again stops now" in line)
        assert hint["level"] == "info" and "130 s" in hint["msg"]  # drainSeconds and the 10 s after it
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)


# a stand-in for a vLLM server that is loading its model: it ignores SIGTERM, as does the engine-core process it
# started, and writes both pids to the file it is given
LOADING_SERVER = textwrap.dedent("""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    core = subprocess.Popen([sys.executable, "-c",
                             "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(sys.argv[1], "w") as f:
        f.write(f"{__import__('os').getpid()} {core.pid}")
    time.sleep(600)
""")


def server_pids(path: Path, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().count(" ") == 1):
        assert time.monotonic() < deadline, "the stand-in server never started"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def test_a_vllm_server_still_loading_dies_with_its_worker_on_sigkill(tmp_path):
    """The worker (here a process with threads, as a worker is) is killed with SIGKILL while its vLLM server
    ignores SIGTERM: the server and its engine-core process are gone within the server's stop grace."""
    pids = tmp_path / "pids"
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, threading, time
        from splitserve.vllm_engine.server import VllmServer
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        VllmServer([sys.executable, "-c", {LOADING_SERVER!r}, {str(pids)!r}], {{}}, "http://127.0.0.1:1",
                   startup_s=600, stop_grace_s=2).start()
        time.sleep(600)
    """)])
    try:
        server, core = server_pids(pids)
        assert alive(server) and alive(core)
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        assert wait_gone([server, core], 2 + 15) == []
    finally:
        worker.kill()


def test_stopping_a_vllm_server_stops_what_ignores_sigterm_and_its_exit_status_is_the_servers(tmp_path):
    from splitserve.vllm_engine.server import VllmServer

    pids = tmp_path / "pids"
    server = VllmServer([sys.executable, "-c", LOADING_SERVER, str(pids)], {}, "http://127.0.0.1:1", startup_s=600,
                        stop_grace_s=1)
    server.start()
    pids_now = server_pids(pids)
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 10
    assert wait_gone(pids_now, 5) == []
    assert server.exited == 128 + signal.SIGKILL  # it ignored SIGTERM: killed after the grace

    failing = VllmServer([sys.executable, "-c", "import sys; sys.exit(3)"], {}, "http://127.0.0.1:1", startup_s=600)
    failing.start()
    assert failing.proc is not None and failing.proc.wait(30) == 3  # as the worker reports a start failure


def test_a_pinned_vllm_server_runs_on_its_cores(tmp_path):
    from splitserve.vllm_engine.server import VllmServer

    core = min(os.sched_getaffinity(0))
    out = tmp_path / "out"
    with out.open("w") as f:
        server = VllmServer([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], {},
                            "http://127.0.0.1:1", startup_s=600, output=f, cores=[core])
        server.start()
        assert server.proc is not None and server.proc.wait(30) == 0
    assert out.read_text().strip() == f"[{core}]"
