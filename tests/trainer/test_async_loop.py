"""Fully-async PPO on a simulated Ray cluster with real vLLM: the rollout pool streams
samples to the trainer pool.

Runs of about a minute each: with stalenessThreshold 0 (synchronous and on-policy),
with 0.5 and partial rollout (learning, version spans, no sample lost or duplicated),
a run resumed from the checkpoint of another (its queue and its prompts in flight
carry over), a run whose vLLM engine is killed with no restart allowed and one whose
rollout rank is killed (each run fails naming it, rather than hangs). (A run with 1,
where generation overlaps scoring, is test_dashboards.py's.) The run with 0.5 has its
engine killed after its first step:
it is restarted in place, and the checks on that run (learning, nothing lost or
trained twice, the staleness bound) hold across the restart.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client import generate_latest

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.loop.sync import StepResult
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.report import ConsoleReporter
from tests.specs import local_async_job
from tests.trainer.learning import assert_reward_rises
from tests.trainer.local_runs import EngineKiller, Trained, train, vllm_series

pytestmark = pytest.mark.slow  # each trains whole runs (minutes)

BATCH = 32  # samples a step: the local example's batchSize
GROUP = 2  # samples per prompt in the resume test
# The elastic run: a loss after step 2, joins after 3, a node lost at the second push to
# three engines (step 6 or so), its replacement, and steps for the last one to generate.
ELASTIC_STEPS = 16


def uids(steps: list[StepResult]) -> list[int]:
    return [uid for s in steps for uid in s.sample_uids]


def test_threshold_zero_trains_every_sample_with_the_policy_that_generated_it(
    tmp_path: Path,
) -> None:
    config = local_async_job(staleness=0, total_steps=6, checkpoint_dir=tmp_path, every_steps=100)
    trained = train(config)
    assert [s.staleness for s in trained.steps] == [[0] * BATCH] * 6
    assert sorted(uids(trained.steps)) == list(range(6 * BATCH))  # admitted in order, all
    # vLLM's own count: at least the trained samples' tokens (the next batch may have
    # started generating when the run ended)
    registry = trained.metrics.registry
    tokens = registry.get_sample_value("rlhf_tokens_generated_total")
    generated = vllm_series(config, registry, "rlhf_vllm_generation_tokens_total")
    assert tokens is not None and sum(generated) >= tokens > 0


STEPS = 60
MIN_RISE = 0.03  # measured: a fitted rise of +0.096 (t = 10.6); the CI run that failed: ~+0.06


@pytest.fixture(scope="module")
def killer() -> EngineKiller:
    return EngineKiller(after_step=1)


@pytest.fixture(scope="module")
def stale(tmp_path_factory: pytest.TempPathFactory, killer: EngineKiller) -> Trained:
    """60 steps with staleness 0.5; its vLLM engine is killed after the first one."""
    config = local_async_job(
        staleness=0.5,
        total_steps=STEPS,
        checkpoint_dir=tmp_path_factory.mktemp("stale"),
        every_steps=STEPS,
    )
    with killer.tagged():
        return train(config, on_step=killer)


def test_a_killed_engine_is_restarted_once_and_the_run_goes_on(
    stale: Trained, killer: EngineKiller
) -> None:
    """The engine killed after step 1 was restarted in place (once), with the requests
    it held run again on it: the other tests on this run check that nothing was lost
    or trained twice, and that the reward still rose."""
    assert len(killer.killed) == 1
    [restarts] = vllm_series(stale.config, stale.metrics.registry, "rlhf_engine_restarts_total")
    assert restarts == 1
    assert [s.step for s in stale.steps] == list(range(1, STEPS + 1))


def test_with_staleness_the_reward_still_rises(stale: Trained) -> None:
    assert_reward_rises([s.reward_mean for s in stale.steps], MIN_RISE)


def test_no_sample_is_lost_or_trained_twice(stale: Trained) -> None:
    trained = uids(stale.steps)
    assert len(trained) == len(set(trained)) == STEPS * BATCH
    # Admission is in uid order and at most 1.5 batches run ahead, so nothing older
    # than that is left behind.
    assert set(range(max(trained) - int(1.5 * BATCH))) <= set(trained)


def test_staleness_stays_within_the_bound_and_some_samples_are_stale(stale: Trained) -> None:
    every = [x for s in stale.steps for x in s.staleness]
    assert max(every) <= 2  # at most one version behind a sync, plus the one in flight
    assert any(x > 0 for x in every)
    registry = stale.metrics.registry
    assert registry.get_sample_value("rlhf_sample_staleness_count") == STEPS * BATCH
    assert registry.get_sample_value("rlhf_weight_sync_seconds_count") == STEPS


def test_a_resumed_run_trains_the_queued_and_in_flight_samples_once(tmp_path: Path) -> None:
    """Run 1 stops after 4 steps with a checkpoint holding the samples not yet trained
    (queued, and prompts in flight); run 2 resumes from it. Every one of those is
    trained by run 2, and nothing run 1 trained is trained again. Prompts are answered
    twice (groups of 2): every step trains whole groups, across the resume too."""
    from rlhf_trainer.loop.fully_async import AsyncState
    from rlhf_trainer.loop.run import ASYNC_STATE
    from rlhf_trainer.roles import checkpoint

    def job(total_steps: int) -> JobConfig:
        return local_async_job(
            staleness=0.5,
            total_steps=total_steps,
            checkpoint_dir=tmp_path,
            every_steps=2,
            samples_per_prompt=GROUP,
        )

    first_run = train(job(4)).steps
    first = uids(first_run)
    latest = checkpoint.latest(tmp_path)
    assert latest is not None
    saved = AsyncState.from_json(checkpoint.load_json(latest, ASYNC_STATE))
    outstanding = {s.uid for s in saved.queued} | {uid for uid, _, _ in saved.in_flight}
    assert outstanding, "the checkpoint held no untrained sample: nothing to check"
    second_run = train(job(6)).steps
    second = uids(second_run)
    assert len(second) == 2 * BATCH
    for step in first_run + second_run:  # uids 2g and 2g+1 answer prompt g
        assert sorted(step.sample_uids) == sorted(
            {u // GROUP * GROUP + i for u in step.sample_uids for i in range(GROUP)}
        )
    assert not set(first) & set(second)  # replays none
    assert outstanding <= set(second)  # loses none
    everything = set(first) | outstanding  # all admitted by run 1, in uid order
    assert everything == set(range(len(everything)))


def test_a_killed_rollout_engine_fails_the_run_rather_than_hanging_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With generation.maxEngineRestarts 0, SIGKILL the rollout pool's vLLM engine after
    the first step. The trainer, waiting for its next batch, gets the rollouter's report
    of the failure, naming the engine, so the job fails (and its restart resumes from
    the checkpoint, see test_resume.py) instead of waiting for samples that will never
    come."""
    from rlhf_trainer.cluster.local import local_ray_cluster
    from rlhf_trainer.loop import fully_async as async_trainer
    from rlhf_trainer.loop.run import run_job
    from rlhf_trainer.rollout.queue import RolloutFailed

    # Without the report the run would hit this instead (an hour by default).
    monkeypatch.setattr(async_trainer, "QUEUE_TIMEOUT_S", 300.0)
    killer = EngineKiller(after_step=1)
    config = local_async_job(
        staleness=0.5, total_steps=30, checkpoint_dir=tmp_path, every_steps=100
    )
    no_restarts = config.generation.model_copy(update={"max_engine_restarts": 0})
    config = config.model_copy(update={"generation": no_restarts})
    metrics = TrainerMetrics(pools=[p.name for p in config.pools])
    named = (
        r"rollout rank 0 \(pool rollout\): vLLM engine died .* generation.maxEngineRestarts is 0"
    )
    with pytest.raises(RolloutFailed, match=named), killer.tagged(), local_ray_cluster(config):
        run_job(config, "async", ConsoleReporter(every=1e9), metrics, on_step=killer)
    assert len(killer.killed) == 1
    # The dead engine breaks no scrape: its series keep the last counts it reported.
    scraped = generate_latest(metrics.registry).decode()
    assert 'rlhf_vllm_generation_tokens_total{engine="0",pool="rollout"}' in scraped


def test_a_lost_rollout_rank_fails_the_run_at_once_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout rank's process is SIGKILLed after the first step, engine and all (a
    lost pod): the trainer, waiting for samples it will never get, finds the rank dead
    within seconds and fails naming it, rather than waiting out the queue's timeout."""
    from rlhf_trainer.cluster.engine_client import TransferFailed
    from rlhf_trainer.cluster.hangs import RankDied
    from rlhf_trainer.cluster.local import local_ray_cluster
    from rlhf_trainer.loop import fully_async as async_trainer
    from rlhf_trainer.loop.run import run_job

    monkeypatch.setattr(async_trainer, "QUEUE_TIMEOUT_S", 300.0)  # a hang fails, later
    killer = EngineKiller(after_step=1, whole_rank=True)
    config = local_async_job(
        staleness=0.5, total_steps=30, checkpoint_dir=tmp_path, every_steps=100
    )
    named = r"rollout rank 0 on pool rollout (\(\w+\) )?(died|lost)"
    # Found by the wait for samples, or by the next call to the rank if the queue
    # already held the next batch (the weight push then names it as it fails).
    with (
        pytest.raises((RankDied, TransferFailed), match=named),
        killer.tagged(),
        local_ray_cluster(config),
    ):
        run_job(config, "async", ConsoleReporter(every=1e9), on_step=killer)
    assert len(killer.killed) == 1


def test_rollout_engines_come_and_go_and_no_sample_is_lost_or_trained_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rollout engines, on two nodes of the rollout pool. As the evaluation after
    step 2 is asked, one's rank is stopped before its half reaches it and SIGKILLed,
    engine and all, once asked: it never answers. The run goes on with the other, which
    generates again what the lost one owed, and answers its half of the evaluation too.
    A new engine starts in the lost one's bundle, on the same node. After step 3 a node
    joins the pool (a bigger `replicas`): an engine starts on it. Each, once up, takes
    the current weights at a sync and then prompts. As the second push to the three
    starts, one's node is killed without warning, its processes with it (a lost pod):
    the push fails on it, the others close the update it opened unserved and take the
    weights again whole. Once Ray has found the node dead, a replacement joins the pool:
    Ray places the lost engine's bundle there, and a new engine starts in it. Through all
    of it, nothing is trained twice or lost, and the staleness bound holds.

    Each fault lands on an event (the evaluation asked, a push started), and after a node
    joins the test waits for the engines starting to be up: the scenario does not depend
    on how fast this machine is."""
    from rlhf_trainer.cluster.groups import join
    from rlhf_trainer.cluster.local import local_ray_cluster, signal_all
    from rlhf_trainer.loop.elastic_rollout import ElasticRollout
    from rlhf_trainer.loop.evaluation import Evaluator
    from rlhf_trainer.loop.run import run_job
    from rlhf_trainer.loop.weights import WeightSync

    spec = local_async_job(
        staleness=0.5, total_steps=ELASTIC_STEPS, checkpoint_dir=tmp_path, every_steps=100
    ).to_dict()
    spec["pools"][-1]["replicas"] = 2  # the rollout pool: one engine per node
    spec["trainer"]["evalEverySteps"] = 2
    config = JobConfig.model_validate(spec)
    metrics = TrainerMetrics(pools=[p.name for p in config.pools])
    push, start_evaluation, elastic_init = WeightSync.push, Evaluator.start, ElasticRollout.__init__
    elastic: list[ElasticRollout] = []
    killed_ranks: list[int] = []  # pids
    to_three: list[int] = []  # the pushes to three engines
    killed_nodes: list[str] = []
    steps: list[StepResult] = []
    with local_ray_cluster(config) as cluster:

        def evaluation_that_loses_an_engine(evaluator: Evaluator, step: int) -> Any:
            if step != 2:
                return start_evaluation(evaluator, step)
            where = evaluator.trainer.groups[Role.ROLLOUT].whereabouts()[0]
            rank = psutil.Process(where.pid)
            held = [rank, *rank.children(recursive=True)]  # its vLLM engine, if a child
            signal_all(held, "suspend")
            done = start_evaluation(evaluator, step)
            signal_all(held, "kill")
            killed_ranks.append(where.pid)
            return done

        def push_after_a_node_kill(sync: WeightSync, version: int) -> None:
            if sync.rollout.world_size == 3:  # both engines that started have joined
                to_three.append(version)
                if len(to_three) == 2:  # a step has shown three engines serving
                    killed_nodes.append(sync.rollout.whereabouts()[0].node_id)
                    cluster.kill_node(killed_nodes[0])
            push(sync, version)

        def keep(self: ElasticRollout, *args: Any) -> None:
            elastic_init(self, *args)
            elastic.append(self)

        monkeypatch.setattr(Evaluator, "start", evaluation_that_loses_an_engine)
        monkeypatch.setattr(WeightSync, "push", push_after_a_node_kill)
        monkeypatch.setattr(ElasticRollout, "__init__", keep)

        def on_step(step: StepResult) -> None:
            steps.append(step)
            if step.step == 3:
                cluster.add_node("rollout")
            if len(killed_nodes) == 1:  # lost in this step's push: Ray found it dead
                assert not node_alive(killed_nodes[0]), "the push went on without Ray's verdict"
                cluster.add_node("rollout")  # the pod that replaces the lost one
                killed_nodes.append("replaced")
            # The engines starting (those on a new node start at the next sync): up
            # before the next sync takes them in, however long they take here.
            (rollout,) = elastic
            join([ready for group in rollout.joining for ready in group.ready], 600)

        trace = tmp_path / "trace.json"
        with caplog.at_level(logging.WARNING):
            run_job(config, "elastic", ConsoleReporter(every=1e9), metrics, trace, on_step)
    assert len(killed_ranks) == 1 and len(killed_nodes) == 2
    assert [s.step for s in steps] == list(range(1, ELASTIC_STEPS + 1))
    evaluations = [e for s in steps for e in s.evaluations]
    assert [e.step for e in evaluations] == list(range(0, ELASTIC_STEPS + 1, 2))
    assert {e.prompts for e in evaluations} == {64}  # whole, the lost half answered again
    assert re.search(r"rollout rank\(s\) \[\d\] are answered again", caplog.text)  # the first
    assert len(re.findall(r"rollout rank \d on pool rollout lost", caplog.text)) == 2
    assert len(re.findall(r"weight push to v\d+ failed on the engine", caplog.text)) == 1
    every = uids(steps)
    assert len(every) == len(set(every)) == ELASTIC_STEPS * BATCH  # none twice
    # None lost: all but the last admitted (still outstanding at the end) are trained,
    # those the lost engines owed among them.
    missing = set(range(max(every) + 1)) - set(every)
    assert all(uid > (ELASTIC_STEPS - 2) * BATCH for uid in missing), sorted(missing)
    # An engine serving weights older than the current ones would show as staleness.
    assert max(lag for s in steps for lag in s.staleness) <= 2
    registry = metrics.registry
    engines = {state: registry.get_sample_value("rlhf_rollout_engines", {"pool": "rollout",
               "state": state}) for state in ("serving", "lost", "joining")}  # fmt: skip
    assert engines == {"serving": 3, "lost": 2, "joining": 0}
    readmitted = registry.get_sample_value("rlhf_samples_readmitted_total")
    assert readmitted is not None and readmitted > 0  # the lost engines owed some
    # The engines that joined generated: ranks 2 and 3 (in the first lost one's bundle,
    # and on the new node), and 4 (in the second lost one's bundle, on its replacement).
    for rank in ("2", "3", "4"):
        joined = {"pool": "rollout", "engine": rank}
        assert (registry.get_sample_value("rlhf_vllm_generation_tokens_total", joined) or 0) > 0
    # Each step says how many engines served; the timeline marks the changes.
    counts = [s.rollout_engines for s in steps]
    assert counts[0] == 2 and 1 in counts and counts[-1] == 3, counts
    marks = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert marks.count("engines_lost") == 2 and marks.count("engines_joined") >= 1, marks


def node_alive(node_id: str) -> bool:
    import ray

    return any(node["NodeID"] == node_id and node["Alive"] for node in ray.nodes())


def test_the_held_out_prompts_are_answered_on_the_rollout_pool_by_the_steps_policy(
    stale: Trained,
) -> None:
    """Every 20 steps, on the weights pushed after that step (one push a step here),
    by the engines alone: the train pool spends no time on it."""
    evaluations = [e for s in stale.steps for e in s.evaluations]
    assert [(e.step, e.policy_version) for e in evaluations] == [(s, s) for s in (0, 20, 40, 60)]
    events = stale.trace["traceEvents"]
    pools = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    answering = [e for e in events if e["ph"] == "X" and e["name"] == "evaluate"]
    assert answering and {pools[e["pid"]] for e in answering} == {"rollout"}
