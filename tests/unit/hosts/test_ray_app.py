"""Ray Serve without Ray processes: a cluster document as deployment options, the Serve config (validated by
Ray's own schema), the KubeRay example, and the control law as Serve's application-level autoscaling policy on
synthetic contexts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.serve")
from ray.serve._private.build_app import build_app  # noqa: E402
from ray.serve._private.common import DeploymentID  # noqa: E402
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config  # noqa: E402
from ray.serve.config import AutoscalingConfig, AutoscalingContext  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from splitserve.autoscaler.actuator import default_profile, load_profile  # noqa: E402
from splitserve.autoscaler.law import ControllerState, LawConfig, decide  # noqa: E402
from splitserve.autoscaler.observations import Observation, Percentiles, RoleObservation  # noqa: E402
from splitserve.common.config_file import ConfigError, load, parse_resource  # noqa: E402
from splitserve.hosts.ray.app import build, cpus, deployment_options, serve_config  # noqa: E402
from splitserve.hosts.ray.policy import LawPolicy, policy_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
LOCAL = ROOT / "deploy/examples/local-cpu.yaml"
GPU = ROOT / "deploy/examples/gpu-llama-8b.yaml"
RAYSERVICE = ROOT / "deploy/ray/rayservice.yaml"


def test_local_cpu_as_deployments() -> None:
    opts = deployment_options(load(LOCAL))
    assert list(opts) == ["redis", "gateway", "prefill", "decode"]  # no redis.url: Serve runs one
    assert opts["redis"] == {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}
    assert opts["gateway"]["num_replicas"] == 1
    assert opts["gateway"]["max_ongoing_requests"] == 256 + 1024  # the gateway's own admission answers 429
    for pool in ("prefill", "decode"):
        assert opts[pool]["num_replicas"] == 1 and "autoscaling_config" not in opts[pool]
        assert opts[pool]["ray_actor_options"] == {"num_cpus": 0.0, "num_gpus": 0}  # device: cpu
        assert opts[pool]["graceful_shutdown_timeout_s"] == 120.0 + 10.0  # drainSeconds, then the exit


def test_gpu_roles_request_their_tensor_parallel_gpus_and_autoscale_within_bounds() -> None:
    resource = load(GPU, {"model.tensor_parallel_size": 2, "autoscaling.mode": "slo", "redis.url": "redis://r:6379"})
    opts = deployment_options(resource)
    assert "redis" not in opts  # redis.url: that Redis
    for pool, lo, hi in (("prefill", 1, 4), ("decode", 1, 8)):
        assert opts[pool]["ray_actor_options"] == {"num_cpus": 8.0, "num_gpus": 2}
        assert "num_replicas" not in opts[pool]
        spec = resource.spec.role(pool)
        assert opts[pool]["autoscaling_config"] == {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": spec.replicas,
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}  # the law's cooldowns are the only ones
    assert opts["gateway"]["ray_actor_options"] == {"num_cpus": 2.0}


def test_colocated_is_one_worker_deployment() -> None:
    opts = deployment_options(load(LOCAL, {"mode": "colocated"}))
    assert list(opts) == ["redis", "gateway", "decode"]
    assert [cpus({"requests": {"cpu": v}}) for v in ("500m", "2", 1)] == [0.5, 2.0, 1.0]


@pytest.mark.parametrize("mode", ["manual", "slo", "external"])
def test_serve_config_passes_rays_schema_and_builds_the_same_deployments(mode: str) -> None:
    resource = load(LOCAL, {"autoscaling.mode": mode})
    config = serve_config(resource, "127.0.0.1", 8123)
    schema = ServeDeploySchema.model_validate(config)  # Ray's own pydantic model of `serve deploy` files
    app = schema.applications[0]
    assert (app.name, app.import_path, app.route_prefix) == ("local-cpu", "splitserve.hosts.ray.app:build", "/")
    assert parse_resource(app.args) == resource  # the args are the cluster document itself
    assert (app.autoscaling_policy is not None) == (mode == "slo")
    assert app.external_scaler_enabled == (mode == "external")
    built = build_app(build(app.args), name=app.name)  # what Serve's controller does with import_path + args
    assert {d.name for d in built.deployments} == set(app.deployment_names)
    assert built.deployments[-1].name == "gateway"  # the ingress
    for d in built.deployments:
        options = next(x for x in config["applications"][0]["deployments"] if x["name"] == d.name)
        if "num_replicas" in options:
            assert d.num_replicas == options["num_replicas"]
        assert d.ray_actor_options == options["ray_actor_options"]


def test_bad_document_fails_the_build_in_one_line() -> None:
    doc = yaml.safe_load(LOCAL.read_text())
    doc["spec"]["prefill"]["replicas"] = -1
    with pytest.raises(ConfigError, match=r"^args: spec.prefill.replicas: must be greater than or equal to 0$"):
        build(doc)


def test_rayservice_example_is_the_serve_config_of_local_cpu() -> None:
    docs = list(yaml.safe_load_all(RAYSERVICE.read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    expected = serve_config(load(LOCAL, {"autoscaling.mode": "slo"}), "0.0.0.0")
    assert serve["applications"] == expected["applications"]
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"
    # every Ray pod carries Serve's settings for our traffic, as serve-ray sets them for a local Ray
    from splitserve.cli import RAY_SERVE_ENV

    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        for container in pod["template"]["spec"]["containers"]:
            assert {e["name"]: e["value"] for e in container.get("env", [])} == RAY_SERVE_ENV, container["name"]


# -- the policy on synthetic contexts ----------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def observation(t: float, decode_ready: int, prefill_ready: int, tokens_per_s: float) -> Observation:
    itl = Percentiles(0.3, 0.5, 0.6, 100) if tokens_per_s else Percentiles()
    return Observation(t, 2.0,
                       RoleObservation("prefill", prefill_ready, arrival_rate=tokens_per_s / 64,
                                       input_tokens_per_s=tokens_per_s / 2, mean_input_tokens=32.0),
                       RoleObservation("decode", decode_ready, arrival_rate=tokens_per_s / 64,
                                       output_tokens_per_s=tokens_per_s, mean_input_tokens=32.0,
                                       mean_output_tokens=64.0, num_running=int(tokens_per_s // 4), itl=itl))


def contexts(targets: dict[str, int], spec) -> dict:
    out = {}
    for pool, n in targets.items():
        role = spec.role(pool)
        config = AutoscalingConfig(min_replicas=role.min_replicas, max_replicas=role.max_replicas,
                                   upscale_delay_s=0.0, downscale_delay_s=0.0)
        dep = DeploymentID(name=pool, app_name="local-cpu")
        out[dep] = AutoscalingContext(
            deployment_id=dep, deployment_name=pool, app_name="local-cpu", current_num_replicas=n,
            target_num_replicas=n, running_replicas=[], total_num_requests=0.0, total_queued_requests=0.0,
            aggregated_metrics={}, raw_metrics={}, capacity_adjusted_min_replicas=role.min_replicas,
            capacity_adjusted_max_replicas=role.max_replicas, policy_state={}, last_scale_up_time=None,
            last_scale_down_time=None, current_time=None, config=config)
    return out


def test_policy_is_the_law_within_the_declared_bounds() -> None:
    """Serve's wrapper (delays at zero) passes the law's decisions through unchanged; each one is what
    `law.decide` gives on the same observations; the P:D bounds hold."""
    resource = load(LOCAL, {"autoscaling.mode": "slo", "autoscaling.interval_seconds": 2.0,
                            "slo.itl_seconds": 0.1, "decode.max_replicas": 3, "ratio.min": 0.5})
    spec = resource.spec
    clock = Clock()
    targets = {"prefill": 1, "decode": 1}
    observed: list[Observation] = []

    def observe(expected) -> Observation:
        load_now = 0.0 if clock.t < 1010 else 60.0  # a load step at t=1010
        obs = observation(clock.t, targets["decode"], targets["prefill"], load_now)
        observed.append(obs)
        return obs

    kwargs = policy_config(resource)["policy_kwargs"]
    policy = LawPolicy(**kwargs, observer=observe, clock=clock)
    serve_policy = _apply_app_level_autoscaling_config(policy)
    law = LawConfig.from_spec(spec, load_profile(default_profile(spec)))
    state = ControllerState()
    ups = 0
    for step in range(40):
        clock.t = 1000.0 + step * 1.0
        decisions, _ = serve_policy(contexts(targets, spec))
        by_pool = {dep.name: n for dep, n in decisions.items()}
        if policy.last is not None and policy.last.time == clock.t:  # the law decided at this call
            expected = decide(observed[-1], state, law)
            state = expected.state
            assert by_pool == expected.replicas
            ups += expected.decode.action == "up"
        else:
            assert by_pool == targets  # between intervals: hold
        assert 1 <= by_pool["decode"] <= 3 and by_pool["prefill"] / by_pool["decode"] >= 0.5
        targets = by_pool
    assert ups >= 1 and targets["decode"] > 1  # the load step added decode replicas
    assert policy.autoscaler.state == state  # its only memory is the law's state


def test_policy_waits_for_the_redis_registry() -> None:
    """No redis.url and no Redis deployment up yet: the policy holds the current targets."""
    resource = load(LOCAL, {"autoscaling.mode": "slo"})
    policy = LawPolicy(**policy_config(resource)["policy_kwargs"])
    policy._make = lambda app: None  # the Directory (Ray's KV) has no Redis URL yet
    decisions, state = policy(contexts({"prefill": 1, "decode": 2}, resource.spec))
    assert {d.name: n for d, n in decisions.items()} == {"prefill": 1, "decode": 2} and state == {}
