"""Soak: mixed traffic for a long while with client cancels and worker kills, on this machine.

`splitserve up` runs colocated workers over its own Redis (kv_aware routing and the KV pool). Clients send a mix
without pause: streamed and whole, chat and completions, greedy and seeded sampling, short and long prompts; one
streamed request in ten is cancelled by its client after a few chunks. Every `--kill-every` seconds the busiest
worker is SIGKILLed and a new one is started in its place (it registers through Redis), so streams in flight move.

Reported: requests sent, completed, cancelled on purpose, and lost (anything else: an HTTP error, an error event,
a finish_reason of error, a stream cut short, a transport error), moves by reason; per long-lived process
(gateway, Redis, workers never killed) RSS after the warm-up and at the end, and open file descriptors; KV blocks
each worker still holds once idle. Goal: 0 lost, RSS growth < 5% after the warm-up (Redis is shown but not held
to it: it holds the KV pool, whose data grows up to kvPool.maxMemory).
Prints a table and ends with one JSON line; `--save NAME` writes benchmarks/results/soak_NAME.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from harness import BIN, Cluster, finish, http_json, report, save, scrape, wait_until

from splitserve.common.proc import free_port

WORDS = "the a river stone light city garden machine story quiet ocean winter letter bridge market song".split()


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = {"sent": 0, "completed": 0, "cancelled": 0, "lost": 0}
        self.lost: list[str] = []

    def add(self, outcome: str, why: str = "") -> None:
        with self.lock:
            self.counts["sent"] += 1
            self.counts[outcome] += 1
            if outcome == "lost" and len(self.lost) < 20:
                self.lost.append(why[:300])


def one_request(client: httpx.Client, url: str, rng: random.Random, tally: Tally) -> None:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.7
    words = rng.randrange(8, 400)
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    body: dict[str, Any] = {"model": "smollm2", "max_tokens": rng.randrange(8, 64), "stream": stream}
    if rng.random() < 0.5:
        body.update(temperature=0.0)
    else:
        body.update(temperature=0.8, seed=rng.randrange(1 << 30))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = text
        path = "/v1/completions"
    cancel_after = rng.randrange(1, 6) if stream and rng.random() < 0.1 else 0
    try:
        if not stream:
            r = client.post(url + path, json=body)
            if r.status_code != 200:
                tally.add("lost", f"{r.status_code} {r.text}")
            elif r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
                tally.add("lost", f"finish_reason {r.json()['choices'][0]['finish_reason']}")
            else:
                tally.add("completed")
            return
        finish, chunks = None, 0
        with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                tally.add("lost", f"{r.status_code} {r.read().decode()}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tally.add("lost", f"error event {event['error']}")
                    return
                for choice in event["choices"]:
                    finish = choice.get("finish_reason") or finish
                chunks += 1
                if cancel_after and chunks >= cancel_after:
                    tally.add("cancelled")
                    return  # leaving the block closes the connection: the gateway aborts the request
        if finish in ("stop", "length"):
            tally.add("completed")
        else:
            tally.add("lost", f"stream ended with finish_reason {finish}")
    except httpx.HTTPError as e:
        tally.add("lost", f"{type(e).__name__}: {e}")


class SoakCluster(Cluster):
    """`splitserve up` with colocated workers over its own Redis (kv_aware routing, the KV pool), whose workers
    this benchmark kills and replaces."""

    def __init__(self, workers: int, kv_pool: bool = True) -> None:
        super().__init__("--mode", "colocated", "--decode", str(workers), "--routing", "kv_aware",
                         *(["--kv-pool"] if kv_pool else []), name="soak")
        self.killed: set[int] = set()
        self.replacements: list[tuple[str, int]] = []  # (gRPC address, pid) of the workers started here

    def workers(self) -> list[dict]:
        return http_json(self.url + "/health")["workers"]

    def replace_busiest(self, n: int) -> str:
        """SIGKILL the worker with the most requests in flight; start a new one under a new name. The last of
        the workers `up` started is never the one (`up` stops the cluster once all of them are gone)."""
        workers = self.workers()
        own = {c["grpc"] for c in self.components["decode"] if c["pid"] not in self.killed}
        if len(own) == 1:
            workers = [w for w in workers if w["endpoint"] not in own]
        victim = max(workers, key=lambda w: w["outstanding"])
        pids = {c["grpc"]: c["pid"] for c in self.components["decode"]} | dict(self.replacements)
        pid = pids[victim["endpoint"]]
        os.kill(pid, signal.SIGKILL)
        self.killed.add(pid)
        port, mport = free_port(), free_port()
        proc = self.spawn(f"soak-{n}", [str(BIN / "splitserve"), "worker", "--config", self.components["config"],
                                        "--role", "both", "--name", f"soak-{n}", "--port", str(port),
                                        "--metrics-port", str(mport), "--host", "127.0.0.1"])
        self.replacements.append((f"127.0.0.1:{port}", proc.pid))
        return victim["name"]

    def long_lived(self) -> dict[str, int]:
        out = {"gateway": self.components["router_pid"], "redis": self.components["redis"]["pid"]}
        for c in self.components["decode"]:
            out[c["name"]] = c["pid"]
        return out


def moves(url: str) -> dict[str, float]:
    """The gateway's moves so far, by their labels ('{reason="...",outcome="..."}')."""
    name = "splitserve_router_migrations_total"
    return {key[len(name):]: value for key, value in scrape(url, (name + "{",)).items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cluster = SoakCluster(args.workers, kv_pool=not args.no_kv_pool)
    tally = Tally()
    stop = threading.Event()
    try:
        wait_until(lambda: sum(w["healthy"] for w in cluster.workers()) == args.workers, 300, "workers")

        def client_loop(k: int) -> None:
            rng = random.Random(args.seed * 100 + k)
            with httpx.Client(timeout=300) as client:
                while not stop.is_set():
                    one_request(client, cluster.url, rng, tally)

        threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(args.clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(args.warmup)
        long_lived = cluster.long_lived()
        rss_warm = {name: rss_bytes(pid) for name, pid in long_lived.items()}
        fds_warm = {name: open_fds(pid) for name, pid in long_lived.items()}
        kills: list[dict[str, Any]] = []
        next_kill = time.monotonic() + args.kill_every
        timeline: dict[str, list[tuple[float, float]]] = {name: [] for name in long_lived}  # (s, RSS MB)
        next_sample = time.monotonic()
        while time.monotonic() - t0 < args.duration:
            if time.monotonic() >= next_sample:
                for name, pid in long_lived.items():
                    rss = rss_bytes(pid)
                    if rss is not None and name in rss_warm:
                        timeline[name].append((round(time.monotonic() - t0, 1), round(rss / 2**20, 1)))
                next_sample += 30.0
            if time.monotonic() >= next_kill:
                victim = cluster.replace_busiest(len(kills))
                kills.append({"at_s": round(time.monotonic() - t0, 1), "worker": victim})
                rss_warm.pop(victim, None)
                next_kill += args.kill_every
            time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(600)
        time.sleep(3.0)  # idle: the last aborts and frees land
        rss_end = {name: rss_bytes(pid) for name, pid in long_lived.items()}
        fds_end = {name: open_fds(pid) for name, pid in long_lived.items()}
        held = {name: stats["kv_blocks_used"] for name, stats in cluster.stats("decode").items()}  # (not the killed)
        processes = {}
        for name in rss_warm:
            if rss_warm[name] and rss_end.get(name):
                processes[name] = {"rss_warm_mb": round(rss_warm[name] / 2**20, 1),
                                   "rss_end_mb": round(rss_end[name] / 2**20, 1),
                                   "rss_growth_pct": round(100 * (rss_end[name] / rss_warm[name] - 1), 2),
                                   "fds_warm": fds_warm.get(name), "fds_end": fds_end.get(name),
                                   "rss_timeline_mb": timeline[name]}
                half = [mb for s, mb in timeline[name] if s >= (args.warmup + args.duration) / 2]
                if half:  # still growing in the second half (a leak), or levelled off (warm-up of the allocator)?
                    processes[name]["rss_growth_second_half_pct"] = round(
                        100 * (rss_end[name] / 2**20 / half[0] - 1), 2)
        return {"duration_s": round(time.monotonic() - t0, 1), **tally.counts, "lost_examples": tally.lost,
                "kills": kills, "moves": moves(cluster.url), "processes": processes, "held_blocks_idle": held,
                # Redis holds the KV pool: it grows with the pool's data up to kvPool.maxMemory, so it is no leak
                "max_rss_growth_pct": max((p["rss_growth_pct"] for name, p in processes.items() if name != "redis"),
                                          default=None)}
    finally:
        stop.set()
        cluster.stop()


def table(r: dict[str, Any]) -> str:
    rows = [f"{r['sent']} requests in {r['duration_s']} s: {r['completed']} completed, {r['cancelled']} cancelled by "
            f"their clients, **{r['lost']} lost**; {len(r['kills'])} workers SIGKILLed and replaced",
            "", "| process | RSS after warm-up (MB) | RSS at end (MB) | growth | growth in the second half | "
            "open fds warm / end |", "| --- | --- | --- | --- | --- | --- |"]
    for name, p in r["processes"].items():
        second = p.get("rss_growth_second_half_pct")
        rows.append(f"| {name} | {p['rss_warm_mb']} | {p['rss_end_mb']} | {p['rss_growth_pct']:+.2f}% | "
                    f"{'-' if second is None else f'{second:+.2f}%'} | {p['fds_warm']} / {p['fds_end']} |")
    rows += ["", f"moves: {r['moves']}", f"KV blocks held once idle: {r['held_blocks_idle']}"]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic, warm-up included")
    p.add_argument("--warmup", type=float, default=90.0, help="seconds before the RSS baseline is taken")
    p.add_argument("--kill-every", type=float, default=150.0, help="seconds between worker kills")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-kv-pool", action="store_true", help="workers without the KV pool (a probe of where RSS goes)")
    p.add_argument("--save", metavar="NAME", help="write benchmarks/results/soak_NAME.json and .md")
    args = p.parse_args()
    result = run(args)
    result["goal_met"] = result["lost"] == 0 and (result["max_rss_growth_pct"] or 0) < 5.0
    text = table(result)
    if args.save:
        save(f"soak_{args.save}", result, report(
            f"Soak: mixed traffic, client cancels and worker kills, this machine ({os.cpu_count()} cores)",
            f"`python benchmarks/soak.py --save {args.save}` (duration {args.duration:g} s, warm-up {args.warmup:g} s, "
            f"a kill every {args.kill_every:g} s, {args.workers} workers, {args.clients} clients)", text, result))
    finish(text, result)


if __name__ == "__main__":
    main()
