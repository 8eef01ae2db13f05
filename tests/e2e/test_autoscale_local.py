"""`splitserve up --autoscale` for real: SmolLM2 on this CPU, the bundled Redis, the SLO control law in the
launcher. A step of long prompts queues on the one prefill worker: the law scales prefill up within the
scale-up cooldown and a second prefill worker starts and registers; when the load ends prefill is scaled back
down by draining (the drained worker finishes its requests and exits), and every request is answered."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from support.serving import Up, metric_sum, scrape

ROOT = Path(__file__).resolve().parents[2]
WORDS = ("alpha", "river", "copper", "violet", "harbor", "signal", "meadow", "quartz", "lantern", "orbit",
         "pepper", "summit", "timber", "velvet", "canyon", "ember", "falcon", "glacier", "island", "jasper")
INTERVAL, UP_COOLDOWN, DOWN_COOLDOWN = 2.0, 15.0, 5.0

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def cluster_file(tmp_path: Path) -> Path:
    doc = yaml.safe_load((ROOT / "deploy" / "examples" / "local-cpu.yaml").read_text())
    spec = doc["spec"]
    spec["model"]["maxModelLen"] = 1024
    # a small token budget per prefill step, so a step of prompts queues (waiting prefill tokens) on the worker
    spec["prefill"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 2, "drainSeconds": 60,
                       "engine": {"kvCacheMemory": "128MiB", "maxNumBatchedTokens": 256}}
    spec["decode"] = {"replicas": 1, "minReplicas": 1, "maxReplicas": 1, "disaggThreshold": 32,
                      "engine": {"kvCacheMemory": "128MiB"}}
    spec["slo"] = {"ttftSeconds": 2.0, "itlSeconds": 1.0}
    spec["autoscaling"] = {"intervalSeconds": INTERVAL, "scaleUpCooldownSeconds": UP_COOLDOWN,
                           "scaleDownCooldownSeconds": DOWN_COOLDOWN, "plannerIntervalSeconds": 4,
                           "coldStartSeconds": 20,
                           "gpuBudget": 3}  # 3 workers on this 2-core box (the core bound would allow 2)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def wait_for(check, timeout: float, what: str) -> float:
    """Poll `check` every 0.5 s; the seconds it took. Fails naming `what`."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.5)
    return time.monotonic() - t0


class Load:
    """`clients` threads sending ~300-token prompts (all different: no prefix-cache hits) until stopped."""

    def __init__(self, url: str, clients: int) -> None:
        self.url = url
        self.stop = threading.Event()
        self.statuses: list[int | str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(280))
            body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
            req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=240) as r:
                    answer = json.loads(r.read())
                    self.statuses.append(r.status if answer["choices"][0]["text"] is not None else "empty")
            except urllib.error.HTTPError as e:
                self.statuses.append(e.code)
            except OSError as e:
                self.statuses.append(f"error: {e}")

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


def test_load_step_scales_prefill_up_then_back_down_with_no_request_lost(tmp_path):
    up = Up("-f", str(cluster_file(tmp_path)), "--autoscale", timeout=300)
    load = None
    try:
        metrics_url = up.components["autoscaler"]["metrics"]

        def m(name: str, **labels: str) -> float:
            return metric_sum(scrape(metrics_url), name, **labels)

        wait_for(lambda: m("splitserve_autoscaler_replicas", role="prefill", state="ready") == 1, 30,
                 "the autoscaler sees the first prefill worker ready")
        assert m("splitserve_autoscaler_desired_replicas", role="prefill") in (0, 1)  # 0: no decision yet

        load = Load(up.url, clients=6)
        took = wait_for(lambda: m("splitserve_autoscaler_desired_replicas", role="prefill") == 2, 60,
                        "prefill scaled up under the load step")
        assert took <= UP_COOLDOWN + 3 * INTERVAL, f"scale-up took {took:.1f} s"
        # the desired count is published before the actuator's log line reaches us: wait for the line too
        wait_for(lambda: "autoscaler: started prefill-1" in "".join(up.stderr), 30, "the second prefill worker started")
        ups = [json.loads(line) for line in up.stderr if '"autoscaler decision' in line]
        assert any(e["decision"]["prefill"]["action"] == "up" for e in ups), ups[-3:]
        # the new worker loads the model and registers; it takes prompts from then on
        wait_for(lambda: m("splitserve_autoscaler_replicas", role="prefill", state="ready") == 2, 120,
                 "the second prefill worker serving")
        time.sleep(4)
        load.end()
        answered = len(load.statuses)
        assert answered >= 6 and all(s == 200 for s in load.statuses), load.statuses

        # after the load: prefill goes back to 1 by draining one worker, which then exits
        wait_for(lambda: m("splitserve_autoscaler_desired_replicas", role="prefill") == 1, 120,
                 "prefill scaled back down after the load")
        assert "autoscaler: draining prefill-" in "".join(up.stderr)
        wait_for(lambda: m("splitserve_autoscaler_replicas", role="prefill", state="ready") == 1
                 and m("splitserve_autoscaler_replicas", role="prefill", state="draining") == 0, 90,
                 "the drained worker gone from the registry")
        assert m("splitserve_autoscaler_decisions_total", role="prefill", direction="up") >= 1
        assert m("splitserve_autoscaler_decisions_total", role="prefill", direction="down") >= 1
        assert m("splitserve_autoscaler_desired_replicas", role="decode") == 1  # decode's maxReplicas
        with urllib.request.urlopen(up.url + "/health", timeout=10) as r:  # the cluster still serves
            assert json.loads(r.read())["all_healthy"]
        text = "".join(up.stderr)
        assert "Traceback" not in text and "did not exit" not in text, text[-3000:]
    finally:
        if load is not None:
            load.end()
        assert up.stop() == 0


def test_the_docs_actuator_commands_are_valid():
    """docs/autoscaling.md's actuator commands: the `up --autoscale` one gives a valid cluster in slo mode with
    its flags applied (the test above runs the same command with a file of its own), and the operator one
    parses."""
    import re
    import shlex
    import subprocess
    import sys

    import click

    from splitserve.cli import app

    text = (ROOT / "docs" / "autoscaling.md").read_text()
    lines = [c for block in re.findall(r"```sh\n(.*?)```", text, re.S) for c in block.replace("\\\n", " ").splitlines()]
    [up_line] = [c for c in lines if "splitserve up" in c and "--autoscale" in c]
    [operator_line] = [c for c in lines if "splitserve operator" in c]
    args = shlex.split(up_line)[1:]
    assert "--autoscale" in args
    res = subprocess.run([sys.executable, "-m", "splitserve.cli", *args, "--dry-run"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    auto = yaml.safe_load(res.stdout)["spec"]["autoscaling"]
    assert (auto["mode"], auto["intervalSeconds"], auto["scaleDownCooldownSeconds"]) == ("slo", 5.0, 60.0)
    argv = shlex.split(operator_line)[1:]
    with click.Context(app, info_name="splitserve") as parent:
        ctx = app.get_command(parent, argv[0]).make_context(argv[0], argv[1:], parent=parent)
    assert ctx.params["metrics_port"] == 9090 and ctx.params["all_namespaces"]
