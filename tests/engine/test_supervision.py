"""Supervised workers (issue 55): a lost prefill worker, decode worker or engine instance is replaced,
the requests it held that nobody saw yet run again elsewhere (greedy tokens equal an undisturbed
run's), the others end with an error, /health answers 503 while no worker of a role is live, and
/metrics counts the restarts.

The first tests drive the orchestrator with mock workers (tokens as in an undisturbed run); the slow ones
kill -9 or SIGSTOP real Ray actors, one small pool per class."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_disagg_orchestrator import DEADLINE, build, drain, mock

from kvmosaic.config import DisaggConfig, DistributedConfig, RestartPolicy
from kvmosaic.disagg.orchestrator import DisaggregatedEngine
from kvmosaic.disagg.verbs import DecodeEngine, PrefillEngine
from kvmosaic.disagg.workers import WorkerLost
from kvmosaic.engine.errors import EngineUnavailableError
from kvmosaic.engine.supervision import RestartBudget
from kvmosaic.sampling_params import SamplingParams

QUICK = RestartPolicy(max_restarts=1, backoff=0.0, max_backoff=0.0, start_timeout=120.0)
# streamed: outputs reach the client; 40 tokens of 10 ms steps outlast the test's reaction
SHOWN = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40)
UNSEEN = dataclasses.replace(SHOWN, final_only=True)  # a JSON body at the end


def test_the_restart_budget_backs_off_and_runs_out_per_slot() -> None:
    now = [0.0]
    budget = RestartBudget(RestartPolicy(max_restarts=2, window=10.0, backoff=1.0, max_backoff=1.5), lambda: now[0])
    assert [budget.grant("a"), budget.grant("a"), budget.grant("a")] == [1.0, 1.5, None]
    assert budget.grant("b") == 1.0  # each slot has its own
    now[0] = 10.5  # the window slid past both restarts of "a"
    assert budget.grant("a") == 1.0


def test_serve_takes_the_restart_budget() -> None:
    from kvmosaic.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--instances", "2", "--max-worker-restarts", "0"])
    assert args.max_worker_restarts == 0
    assert build_parser().parse_args(["serve"]).max_worker_restarts == 3
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)


class DyingDecode(DecodeEngine):
    """A decode worker whose generate raises WorkerLost once ``die`` is set (a killed actor)."""

    def __init__(self) -> None:
        super().__init__(executor=mock())
        self.die = threading.Event()

    def generate(self):
        time.sleep(0.01)
        if self.die.is_set():
            raise WorkerLost("the actor died")
        return super().generate()


class Spawner:
    """Replacement workers, started once ``gate`` is open."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()

    def spawn(self, role: str, index: int):
        assert self.gate.wait(DEADLINE)
        return DyingDecode() if role == "decode" else PrefillEngine(executor=mock())


def supervised(spawner: Spawner, policy: RestartPolicy = QUICK) -> tuple[DisaggregatedEngine, DyingDecode]:
    decode = DyingDecode()
    ref = mock()
    engine = DisaggregatedEngine([PrefillEngine(executor=mock())], [decode], config=ref.config,
                                 model_config=ref.model_config, tokenizer=ref.tokenizer,
                                 disagg=DisaggConfig(restart=policy), spawner=spawner)
    return engine, decode


def until(predicate, seconds: float = DEADLINE) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.01)


def test_a_lost_decode_worker_is_replaced_and_reruns_what_nobody_saw() -> None:
    undisturbed = build()
    try:
        expected = drain_all(undisturbed, {"a": ("t1 t2 t3", UNSEEN), "b": ("t2", SHOWN)})
    finally:
        undisturbed.shutdown()
    spawner = Spawner()
    engine, decode = supervised(spawner)
    try:
        engine.add_request("a", "t1 t2 t3", UNSEEN)
        engine.add_request("b", "t2", SHOWN)
        seen: set[str] = set()
        while seen != {"a", "b"}:  # both produced a token
            seen |= {out.request_id for out in engine.step()}
        spawner.gate.clear()  # the replacement waits: no decode worker is live meanwhile
        decode.die.set()
        until(lambda: not engine.serving_state().ready)
        assert engine.serving_state().reason == "no decode worker is live (restarting)"
        spawner.gate.set()
        done = drain(engine)
        assert done["a"] == expected["a"]  # run again from the start on the replacement
        assert done["b"][1] == "abort" and "decode worker 0 was lost" in done["b"][2]
        assert engine.serving_state().ready
        stats = engine.stats()
        assert stats["worker_restarts"] == {"prefill": 0, "decode": 1} and stats["disagg_reruns"] == 1
        assert stats["workers_live"] == {"prefill": 1, "decode": 1}
        assert drain_all(engine, {"c": ("t2", SHOWN)})["c"] == expected["b"]
    finally:
        engine.shutdown()


def test_a_spent_restart_budget_leaves_the_engine_unavailable() -> None:
    engine, decode = supervised(Spawner(), dataclasses.replace(QUICK, max_restarts=0))
    try:
        engine.add_request("a", "t1", SHOWN)
        decode.die.set()
        done = drain(engine)
        assert done["a"][1] == "abort"
        assert engine.serving_state().reason == "no decode worker is live"
        with pytest.raises(EngineUnavailableError, match="every decode worker is lost"):
            engine.add_request("b", "t1", SHOWN)
    finally:
        engine.shutdown()


def drain_all(engine: DisaggregatedEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    return drain(engine)


# ---------------------------------------------------------------------------------------- on Ray
ROLE_SERIES = re.compile(r'^kvmosaic_(workers_live|worker_restarts_total)\{role="(\w+)"\} (\S+)$', re.M)


def role_series(http) -> dict[tuple[str, str], float]:
    return {(m[1], m[2]): float(m[3]) for m in ROLE_SERIES.finditer(http.get("/metrics").text)}


def wait_http(predicate, what: str, seconds: float = 30.0) -> float:
    """Seconds until ``predicate()`` held."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < seconds, f"never {what}"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.fixture(scope="class")
def served(ray_runtime):
    httpx = pytest.importorskip("httpx")
    from test_disagg_model import config

    from kvmosaic.disagg.ray_workers import build_disaggregated
    from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig

    disagg = DisaggConfig(rpc_timeout=20.0, ping_interval=0.5, ping_timeout=3.0,
                          restart=dataclasses.replace(QUICK, max_restarts=2, backoff=0.2, max_backoff=0.2))
    base = config("auto")  # room for a 1,500-token prompt, prefilled in 32-token chunks: seconds to kill it in
    cfg = dataclasses.replace(base, cache=dataclasses.replace(base.cache, kv_cache_memory="128MiB"),
                              scheduler=dataclasses.replace(base.scheduler, max_model_len=2048))
    engine = build_disaggregated(cfg, disagg)
    try:
        with (BackgroundServer(engine, ServerConfig(port=0, shutdown_grace=1.0)) as server,
              httpx.Client(base_url=server.url, timeout=120) as http):
            yield engine, http
    finally:
        engine.shutdown()


@pytest.mark.slow
class TestDisaggregatedOnRay:
    def test_killed_decode_worker(self, served):
        from test_disagg_server import Stream, body

        engine, http = served
        prompts = [[1000 + i, 2000, 3000] for i in range(2)]
        undisturbed = [http.post("/v1/completions", json=body(p, 48)).json()["choices"][0]["text"] for p in prompts]
        stream = Stream(http, body([1500, 2500], 300, stream=True))
        stream.read(2)
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(http.post, "/v1/completions", json=body(p, 48)) for p in prompts]
            wait_http(lambda: engine.stats()["num_running"] >= 3, "three running")
            os.kill(engine.decode_workers[0].process[1], signal.SIGKILL)
            killed = time.monotonic()
            stream.read()
            assert stream.error is not None  # it had sent tokens: it cannot start over unseen
            stream.close()
            texts = [a.result().json()["choices"][0]["text"] for a in answers]
        assert texts == undisturbed  # run again from the start on the replacement
        wait_http(lambda: role_series(http).get(("workers_live", "decode")) == 1.0, "the decode worker back")
        assert time.monotonic() - killed < 30
        series = role_series(http)
        assert series[("worker_restarts_total", "decode")] == 1.0 and series[("workers_live", "prefill")] == 1.0
        assert "kvmosaic_disagg_reruns_total 2.0" in http.get("/metrics").text
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=body(prompts[0], 48)).json()["choices"][0]["text"] == undisturbed[0]

    def test_killed_idle_prefill_worker_and_health(self, served):
        from test_disagg_server import body

        engine, http = served
        os.kill(engine.prefill_workers[0].process[1], signal.SIGKILL)
        wait_http(lambda: http.get("/health").status_code == 503, "503 while the prefill worker restarts", 10)
        answer = http.post("/v1/completions", json=body([1000, 2000, 3000], 4))  # waits for the replacement
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        wait_http(lambda: http.get("/health").status_code == 200, "200 after recovery")
        assert role_series(http)[("worker_restarts_total", "prefill")] == 1.0

    def test_prefill_worker_killed_mid_prefill(self, served):
        from test_disagg_server import body, metrics, wait_for

        engine, http = served
        request = body(list(range(3000, 4500)), 4)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(http.post, "/v1/completions", json=request)
            wait_for(http, lambda plain, _: plain["disagg_pending_prefills"] == 0 and plain["num_requests_queued"] == 1,
                     "the prompt in prefill")
            os.kill(engine.prefill_workers[0].process[1], signal.SIGKILL)
            text = answer.result().json()["choices"][0]["text"]  # prefilled again by the replacement
        assert text == http.post("/v1/completions", json=request).json()["choices"][0]["text"]
        plain, _ = metrics(http)
        assert plain["disagg_prefill_retries_total"] == 1.0
        assert role_series(http)[("worker_restarts_total", "prefill")] == 2.0

    def test_stopped_decode_worker(self, served):
        from test_disagg_server import body

        engine, http = served
        request = body([1200, 2200, 3200], 48)
        undisturbed = http.post("/v1/completions", json=request).json()["choices"][0]["text"]
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(http.post, "/v1/completions", json=request)
            wait_http(lambda: engine.stats()["num_running"] >= 1, "running")
            pid = engine.decode_workers[0].process[1]
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                assert answer.result().json()["choices"][0]["text"] == undisturbed  # ran again, unseen
            finally:
                with_gone(pid, signal.SIGCONT)
        assert time.monotonic() - stopped < 30  # lost after a missed ping (3 s), replaced, run again
        assert role_series(http)[("worker_restarts_total", "decode")] == 2.0

    def test_a_spent_budget_is_a_503_not_a_400(self, served):
        from test_disagg_server import body

        engine, http = served
        os.kill(engine.decode_workers[0].process[1], signal.SIGKILL)  # its two restarts are used up
        wait_http(lambda: http.get("/health").status_code == 503, "503 with no decode worker left", 10)
        assert engine.serving_state().reason == "no decode worker is live"
        answer = http.post("/v1/completions", json=body([1000, 2000, 3000], 4))
        assert answer.status_code == 503, answer.text


@pytest.fixture(scope="class")
def cluster(ray_runtime):
    from test_distributed_cluster import BLOCKS, engine_config

    from kvmosaic.distributed.cluster import Cluster

    restart = dataclasses.replace(QUICK, max_restarts=3, backoff=0.2, max_backoff=0.2)
    dist = DistributedConfig(num_instances=2, heartbeat_interval=0.2, missed_heartbeats=25, dgfm_interval=0,
                             rpc_timeout=8.0, poll_timeout=3.0, restart=restart)
    cl = Cluster(engine_config(BLOCKS), dist)
    yield cl
    cl.shutdown()

@pytest.fixture(scope="class")
def reference(cached_loader):
    """Greedy token ids of one in-process engine with a large pool."""
    from test_distributed_cluster import engine_config

    from kvmosaic.engine.engine import Engine
    from kvmosaic.executor.local import LocalExecutor

    engine = Engine(engine_config(256), LocalExecutor(engine_config(256), cached_loader))

    def run(tokens: list[int], max_tokens: int) -> list[int]:
        engine.add_request("ref", tokens, greedy(max_tokens))
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    result = out.outputs[0].token_ids
        return result

    return run


@pytest.mark.slow
class TestClusterOnRay:
    def test_killed_instance(self, cluster, reference):
        from test_distributed_cluster import drive, prompt

        unseen, shown = prompt(40, 60), prompt(41, 50)
        cluster.add_request("n", unseen, greedy(24, final_only=True), instance=1)
        cluster.add_request("s", shown, greedy(200), instance=1)
        finished: dict = {}
        drive(cluster, finished, until=lambda: {"n", "s"} <= set(cluster.last_output))
        os.kill(ray_get(cluster.instances[1].pid.remote()), signal.SIGKILL)
        killed = time.monotonic()
        drive(cluster, finished)
        assert finished["n"].outputs[0].token_ids == reference(unseen, 24)  # ran again on instance 0
        assert finished["s"].outputs[0].finish_reason == "abort"
        assert "instance 1 failed" in finished["s"].outputs[0].stop_reason
        assert 1 not in cluster.instance_stats()  # its pool went with it
        wait_http(lambda: replaced(cluster), "the instance replaced")
        assert time.monotonic() - killed < 30
        stats = fresh_stats(cluster)
        assert stats["worker_restarts"] == {"instance": 1} and stats["workers_live"] == {"instance": 2}
        assert stats["dist_reruns"] == 1 and stats["kv_blocks_used"] == 0
        # the replacement (a fresh id) borrows from the survivor: wired to it both ways
        new = max(cluster.instances)
        long_prompt = prompt(42, 300)  # 300 + 6 tokens: more than one pool
        cluster.add_request("long", long_prompt, greedy(6, final_only=True), instance=new)
        drive(cluster, finished)
        assert finished["long"].outputs[0].token_ids == reference(long_prompt, 6)
        assert fresh_stats(cluster)["dist_loans_total"] >= 1

    def test_stopped_instance(self, cluster, reference):
        from test_distributed_cluster import drive, prompt

        victim, survivor = sorted(cluster.instances)
        held, other = prompt(50, 40), prompt(51, 30)
        cluster.add_request("h", held, greedy(24, final_only=True), instance=victim)
        finished: dict = {}
        drive(cluster, finished, until=lambda: "h" in cluster.last_output)
        with stopped(ray_get(cluster.instances[victim].pid.remote())):
            start = time.monotonic()
            cluster.add_request("o", other, greedy(4), instance=survivor)
            drive(cluster, finished)  # its poll misses the deadline: lost, and "h" runs again on the survivor
            assert time.monotonic() - start < cluster.dist_config.poll_timeout + 15
        assert finished["h"].outputs[0].token_ids == reference(held, 24)
        assert finished["o"].outputs[0].token_ids == reference(other, 4)
        wait_http(lambda: replaced(cluster), "the stopped instance replaced")
        idle = max(cluster.instances)  # the replacement
        with stopped(ray_get(cluster.instances[idle].pid.remote())):
            start = time.monotonic()
            with pytest.raises(EngineUnavailableError):
                cluster.add_request("x", other, greedy(4), instance=idle)
            assert time.monotonic() - start < cluster.dist_config.rpc_timeout + 5  # a bounded wait, then lost
        wait_http(lambda: replaced(cluster), "the stopped replacement replaced")
        assert fresh_stats(cluster)["worker_restarts"] == {"instance": 3}

    def test_an_idle_instance_lost_on_add_sends_the_request_to_the_survivor(self, cluster, reference):
        from test_distributed_cluster import drive, prompt

        idle = min(cluster.instances)  # where the next request goes: both are idle, lowest id first
        os.kill(ray_get(cluster.instances[idle].pid.remote()), signal.SIGKILL)
        tokens = prompt(60, 30)
        cluster.add_request("after", tokens, greedy(4))  # no 400: the lost one is passed over
        assert cluster.route["after"] != idle and idle not in cluster.instances
        finished: dict = {}
        drive(cluster, finished)
        assert finished["after"].outputs[0].token_ids == reference(tokens, 4)


    def test_health_over_http_while_every_instance_is_down(self, cluster, reference):
        httpx = pytest.importorskip("httpx")
        from test_disagg_server import body
        from test_distributed_cluster import prompt

        from kvmosaic.entrypoints.openai.api_server import BackgroundServer, ServerConfig

        wait_http(lambda: replaced(cluster), "both instances live")
        with (BackgroundServer(cluster, ServerConfig(port=0, shutdown_grace=1.0)) as server,
              httpx.Client(base_url=server.url, timeout=120) as http):
            assert http.get("/health").status_code == 200
            for handle in list(cluster.instances.values()):
                os.kill(ray_get(handle.pid.remote()), signal.SIGKILL)
            # the server's loop finds them lost (the gManager's verdict) and replaces them while idle
            wait_http(lambda: http.get("/health").status_code == 503, "503 with no live instance")
            wait_http(lambda: http.get("/health").status_code == 200, "200 once replaced", 60)
            tokens = prompt(70, 20)
            answer = http.post("/v1/completions", json=body(tokens, 4))
            assert answer.json()["choices"][0]["text"] == cluster.tokenizer.decode(reference(tokens, 4))
            wait_http(lambda: role_series(http)[("workers_live", "instance")] == 2.0, "both replaced")
            assert role_series(http)[("worker_restarts_total", "instance")] == 6.0  # this class's kills


def greedy(max_tokens: int, final_only: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, final_only=final_only)


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=30)


def replaced(cluster) -> bool:
    """Whether both slots are live again (stepping lets an idle cluster wire its replacements)."""
    cluster.step()
    return len(cluster.instances) == 2


def fresh_stats(cluster) -> dict:
    cluster._stats_cache = None
    return cluster.stats()


@contextlib.contextmanager
def stopped(pid: int):
    """The process SIGSTOPped (hung) for the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with_gone(pid, signal.SIGCONT)


def with_gone(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # killed when it was declared lost
        os.kill(pid, sig)
