"""`engine: native | vllm` in the configuration model and what it becomes, with no vLLM server running: settings
vLLM cannot honour are one line naming the field; the vLLM command line and environment derived from the model;
the pull handover's ticket and receipt validated off the wire; what the engine reads off vLLM's API and metrics
(the command-line checks and the NIXL pacing plugin: tests/e2e/test_engine_config_cli.py)."""

from __future__ import annotations

import json

import pytest

from splitserve.common.config import ClusterResource
from splitserve.engine.interface import BadTicket, HandoverFailed
from splitserve.vllm_engine.pull_handover import TICKET, check_ticket, parse_receipt
from splitserve.vllm_engine.server import VllmPorts, VllmStartError, command, environment
from splitserve.vllm_engine.wire import (
    VllmProtocolError,
    parse_choice,
    parse_load,
    parse_logprobs,
    request_body,
)

PORTS = VllmPorts(8200, 5557, 5600)


def cluster(**spec) -> ClusterResource:
    return ClusterResource.model_validate({"metadata": {"name": "t"}, "spec": spec})


def test_the_vllm_command_follows_the_model():
    spec = cluster(engine="vllm", model={"device": "cpu", "maxModelLen": 2048, "dtype": "float32"},
                   decode={"engine": {"maxNumSeqs": 7, "vllmArgs": ["--max-num-partial-prefills", "2"]}},
                   vllm={"args": ["--quantization", "fp8"]}).spec
    cmd = command(spec, "decode", "/models/m", PORTS)
    flags = dict(zip(cmd, cmd[1:], strict=False))
    assert cmd[1:4] == ["-P", "-m", "vllm.entrypoints.openai.api_server"]  # -P: no checkout shadows splitserve
    assert flags["--model"] == "/models/m" and flags["--port"] == "8200" and flags["--host"] == "127.0.0.1"
    assert flags["--block-size"] == "32" and flags["--max-num-seqs"] == "7" and flags["--dtype"] == "float32"
    assert flags["--max-model-len"] == "2048" and "--enforce-eager" in cmd  # eager on CPU
    auto = cluster(engine="vllm", model={"device": "cpu"}).spec  # auto: float32 on CPU, as for native workers
    auto_cmd = command(auto, "decode", "/models/m", PORTS)
    assert auto_cmd[auto_cmd.index("--dtype") + 1] == "float32"
    transfer = json.loads(flags["--kv-transfer-config"])  # vllm.connector: layerwise by default
    assert transfer["kv_connector"] == "SplitserveLayerwiseConnector" and transfer["kv_load_failure_policy"] == "recompute"
    assert transfer["kv_connector_module_path"] == "splitserve.vllm_engine.in_vllm.layerwise_connector"
    assert transfer["kv_connector_extra_config"]["splitserve_layerwise"]["control"] == "tcp://127.0.0.1:5558"
    for name, kind in (("pull", "NixlConnector"), ("push", "NixlPushConnector")):
        other = cluster(engine="vllm", model={"device": "cpu"}, vllm={"connector": name}).spec
        other_cmd = command(other, "decode", "/m", PORTS)
        entry = json.loads(other_cmd[other_cmd.index("--kv-transfer-config") + 1])
        assert entry["kv_connector"] == kind and entry["kv_buffer_device"] == "cpu"
    events = json.loads(flags["--kv-events-config"])
    assert events["endpoint"] == "tcp://127.0.0.1:5557" and events["enable_kv_cache_events"]
    assert cmd[-4:] == ["--quantization", "fp8", "--max-num-partial-prefills", "2"]  # cluster's, then role's
    colocated = cluster(engine="vllm", mode="colocated").spec
    assert "--kv-transfer-config" not in command(colocated, "both", "/m", PORTS)
    env = environment(spec, "decode", PORTS, "10.0.0.7")
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.7" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["SPLITSERVE_NIXL_PROGRESS_DELAY_US"] == "1000"
    assert env["SPLITSERVE_UCX_LOG_DIR"].startswith("/tmp/")  # UCX's transport tables, for /health
    big = cluster(engine="vllm", model={"device": "cpu"}, decode={"engine": {"kvCacheMemory": "2.5GiB"}}).spec
    assert environment(big, "decode", PORTS, "h")["VLLM_CPU_KVCACHE_SPACE"] == "3"
    gpu = cluster(engine="vllm", model={"device": "cuda:1"}, decode={"engine": {"kvCacheMemory": "0.8"}}).spec
    gcmd = command(gpu, "decode", "/m", PORTS)
    assert gcmd[gcmd.index("--gpu-memory-utilization") + 1] == "0.8" and "--enforce-eager" not in gcmd
    assert environment(gpu, "decode", PORTS, "h")["CUDA_VISIBLE_DEVICES"] == "1"
    assert "VLLM_BATCH_INVARIANT" not in environment(gpu, "decode", PORTS, "h")


def test_batch_invariance_reaches_vllm_on_a_gpu_and_stops_a_cpu_server_before_it_starts(monkeypatch):
    from splitserve.vllm_engine import server

    on = {"engine": {"batchInvariant": True}}
    gpu = cluster(engine="vllm", model={"device": "cuda"}, prefill=on, decode=on).spec
    assert environment(gpu, "prefill", PORTS, "h")["VLLM_BATCH_INVARIANT"] == "1"
    auto = cluster(engine="vllm", decode=on).spec  # device auto: CPU or GPU is known on the worker's host only
    monkeypatch.setattr(server, "is_cpu", lambda spec: True)
    with pytest.raises(VllmStartError, match="decode.engine.batchInvariant: .* GPUs only"):
        environment(auto, "decode", PORTS, "h")
    monkeypatch.setattr(server, "is_cpu", lambda spec: False)
    assert environment(auto, "decode", PORTS, "h")["VLLM_BATCH_INVARIANT"] == "1"


def test_tickets_and_receipts_are_validated_off_the_wire():
    check_ticket(TICKET)
    for bad in (b"", b"{}", b"not json", b'{"handover": "vllm-pull", "v": 2}', b'{"engine": "native"}'):
        with pytest.raises(BadTicket):
            check_ticket(bad)
    good = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": "e", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1}
    assert parse_receipt(json.dumps(good).encode()) == good
    for bad in ({**good, "do_remote_prefill": False}, {**good, "remote_port": 0}, {**good, "remote_host": ""},
                {**good, "x": {"nested": "object"}}, {**good, "remote_block_ids": [[[[1]]]]}, [1, 2]):
        with pytest.raises(HandoverFailed):
            parse_receipt(json.dumps(bad).encode())
    with pytest.raises(HandoverFailed):
        parse_receipt(b"x" * (65 << 10))


def test_what_the_engine_reads_off_vllm():
    chunk = {"choices": [{"token_ids": [5, 6], "finish_reason": None,
                          "logprobs": {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-0.5, -1.0],
                                       "top_logprobs": [{"token_id:5": -0.5, "token_id:9": -2.0}, None]}}]}
    ids, lp, finish, _ = parse_choice(chunk, vocab_size=10)
    assert ids == [5, 6] and finish is None
    logprobs = parse_logprobs(lp, 2, 1)
    assert [x.token_id for x in logprobs] == [5, 6] and logprobs[0].top == [(5, -0.5)]
    for bad in ({"choices": [{"token_ids": [10]}]}, {"choices": [{"token_ids": [-1]}]}, {"choices": "x"},
                {"error": {"message": "boom"}}, [1]):
        with pytest.raises(VllmProtocolError):
            parse_choice(bad, vocab_size=10)
    text = ('vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="728"} 1.0\n')
    load = parse_load(text)
    assert (load.num_waiting, load.num_running, load.kv_usage, load.num_kv_blocks) == (3, 2, 0.25, 728)
    from splitserve.common.sampling import SamplingParams

    body = request_body("m", "r1", [1, 2], SamplingParams(max_tokens=4, temperature=0.0, stop=["x"]), 0, True)
    assert body["prompt"] == [1, 2] and body["return_token_ids"] and "stop" not in body  # the gateway stops
    # a moved request: greedy continues as it was; a seeded one gets a seed of its own per resume position
    resumed = request_body("m", "r1", [1, 7, 8], SamplingParams(seed=5, temperature=0.8, output_offset=2), 0, True)
    again = request_body("m", "r1", [1, 7, 8], SamplingParams(seed=5, temperature=0.8, output_offset=2), 0, True)
    assert resumed["seed"] == again["seed"] != 5 and 0 <= resumed["seed"] < 1 << 63
    assert request_body("m", "r1", [1], SamplingParams(seed=5), 0, True)["seed"] == 5


def test_data_parallel_ranks_reach_vllm_and_count_as_gpus():
    spec = cluster(engine="vllm", mode="colocated", model={"device": "cuda", "tensorParallelSize": 2,
                                                           "expertParallel": True},
                   decode={"engine": {"dataParallelSize": 4}}).spec
    cmd = command(spec, "both", "/models/m", PORTS)
    flags = dict(zip(cmd, cmd[1:], strict=False))
    assert flags["--tensor-parallel-size"] == "2" and flags["--data-parallel-size"] == "4"
    assert "--enable-expert-parallel" in cmd and spec.gpus_per_worker("both") == 8
    assert "--data-parallel-size" not in command(cluster(engine="vllm").spec, "decode", "/m", PORTS)


def test_vllm_cpu_servers_on_one_host_get_cores_of_their_own(monkeypatch):
    from splitserve.vllm_engine.server import cpu_binding

    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(8)))
    assert [cpu_binding(i, 2, 1) for i in range(3)] == ["0,1,2,3", "4,5,6,7", "0,1,2,3"]  # a third wraps around
    assert cpu_binding(1, 2, 2) == "4,5|6,7"  # one list per tensor-parallel rank
    assert cpu_binding(0, 3, 1) == "0,1" and cpu_binding(2, 3, 1) == "4,5"
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1})
    # more servers than cores: a core each, in turn (two servers on one core beat three on every core)
    assert [cpu_binding(i, 3, 1) for i in range(3)] == ["0", "1", "0"]
    assert cpu_binding(0, 2, 2) == "0|1"
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0})
    assert cpu_binding(1, 2, 2) is None  # fewer cores than ranks: vLLM's own binding


def test_a_bound_one_rank_cpu_server_runs_its_model_in_its_engine_core_process(monkeypatch):
    from splitserve.vllm_engine.server import environment, inline_cores, parse_cores

    assert parse_cores("0,1") == [0, 1] and parse_cores("0-2,8") == [0, 1, 2, 8]
    assert parse_cores("0|1") is parse_cores("all") is parse_cores("") is parse_cores("1-") is None
    spec = cluster(engine="vllm", model={"device": "cpu"}).spec
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2,3")
    cmd = command(spec, "decode", "/m", PORTS)
    assert dict(zip(cmd, cmd[1:], strict=False))["--distributed-executor-backend"] == "uni"
    env = environment(spec, "decode", PORTS, "127.0.0.1")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "2"
    assert inline_cores(spec, "decode") == [2, 3]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the operator's own thread count wins
    assert "OMP_NUM_THREADS" not in environment(spec, "decode", PORTS, "127.0.0.1")
    # a binding per rank, or none: vLLM's own processes
    for binding in ("2|3", "nobind"):
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", binding)
        assert "--distributed-executor-backend" not in command(spec, "decode", "/m", PORTS)
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in environment(spec, "decode", PORTS, "127.0.0.1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0,1")
    tp = cluster(engine="vllm", model={"device": "cpu", "tensorParallelSize": 2}).spec
    assert inline_cores(tp, "decode") is None
