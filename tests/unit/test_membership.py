"""The engine-membership machine (`loop.membership`), one test per row of TRANSITIONS,
driven through a fake pool and a fake weight sync: no Ray. Each fault is scripted on
an event (the n-th reopen, push or wait for replacements), never on a clock."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from rlhf_trainer.api.config import Role
from rlhf_trainer.api.plan import PlacementPlan
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.hangs import NoAnswer, RankDied, RanksLost
from rlhf_trainer.cluster.placement import WorkerSlot
from rlhf_trainer.cluster.role_groups import RoleGroups, WorkerSpec
from rlhf_trainer.loop.evaluation import EvaluationLost
from rlhf_trainer.loop.membership import (
    TRANSITIONS,
    EngineMembership,
    EngineRestartsExhausted,
    Event,
    NotPlaced,
    Replacement,
    State,
    classify,
)
from rlhf_trainer.loop.weights import EnginesStuck, SyncFailure, WeightSync
from rlhf_trainer.rollout.push_verdict import PushFailed
from rlhf_trainer.rollout.sync_deadlines import Stall
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.report import failure_line
from rlhf_trainer.telemetry.timeline import Timeline
from rlhf_trainer.worker import Worker

POOL = "gen"
Outcome = Callable[[], None] | BaseException | None  # a call's scripted outcome


@dataclass
class World:
    """What the fakes share: which ranks died, which were shut down, and the scripted
    outcomes of each operation, one per call in order (none left: it succeeds)."""

    dead: set[int] = field(default_factory=set)
    shut: list[int] = field(default_factory=list)
    script: dict[str, deque[Outcome]] = field(default_factory=dict)

    def on(self, operation: str, *outcomes: Outcome) -> None:
        self.script.setdefault(operation, deque()).extend(outcomes)

    def call(self, operation: str) -> None:
        outcomes = self.script.get(operation)
        outcome = outcomes.popleft() if outcomes else None
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is not None:
            outcome()

    def kill(self, *ranks: int) -> Callable[[], None]:
        """An outcome: the engines of `ranks` die (the call itself succeeds)."""
        return lambda: self.dead.update(ranks)


def slot(index: int) -> WorkerSlot:
    return WorkerSlot(POOL, index, 1.0)


@dataclass
class FakeGroup:
    """The part of WorkerGroup the membership uses."""

    world: World
    ranks: tuple[int, ...]
    slots: list[WorkerSlot]
    role: str = Role.ROLLOUT

    @property
    def pool(self) -> str:
        return POOL

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def pairs(self) -> list[tuple[int, WorkerSlot]]:
        return list(zip(self.ranks, self.slots, strict=True))

    def _of(self, pairs: Sequence[tuple[int, WorkerSlot]]) -> FakeGroup:
        return FakeGroup(self.world, tuple(r for r, _ in pairs), [s for _, s in pairs])

    def without(self, ranks: Sequence[int]) -> FakeGroup:
        return self._of([(r, s) for r, s in self.pairs if r not in ranks])

    def joined(self, other: FakeGroup) -> FakeGroup:
        return self._of(sorted([*self.pairs, *other.pairs]))

    def substituted(self, new: FakeGroup) -> FakeGroup:
        taking = {s: r for r, s in new.pairs}
        return self._of([(taking.get(s, r), s) for r, s in self.pairs])

    def dead_ranks(self) -> list[int]:
        self.world.call("dead_ranks")
        return [rank for rank in self.ranks if rank in self.world.dead]

    def shutdown(self, grace_s: float = 0) -> None:
        self.world.shut += self.ranks


class FakePool:
    """The part of RoleGroups the membership uses."""

    def __init__(self, world: World, engines: int) -> None:
        self.world = world
        self.serving = FakeGroup(world, tuple(range(engines)), [slot(i) for i in range(engines)])
        self.next_rank = engines
        self.respawned: list[list[int]] = []

    def __getitem__(self, role: Role) -> WorkerGroup:
        return cast(WorkerGroup, self.serving)

    def replace(self, group: WorkerGroup) -> None:
        self.serving = cast(FakeGroup, group)

    def respawn(
        self, role: Role, slots: Sequence[WorkerSlot], worker: WorkerSpec
    ) -> list[WorkerGroup]:
        ranks = tuple(range(self.next_rank, self.next_rank + len(slots)))
        self.next_rank += len(slots)
        self.respawned.append(list(ranks))
        return [cast(WorkerGroup, FakeGroup(self.world, ranks, list(slots)))] if slots else []

    def start_more(self, plan: PlacementPlan, role: Role, worker: WorkerSpec) -> WorkerGroup | None:
        return None

    def started_up(self, groups: Sequence[WorkerGroup], timeout_s: float) -> WorkerGroup:
        self.world.call("started_up")
        return functools.reduce(lambda a, b: a.joined(b), groups)

    def start_ended(self, group: WorkerGroup) -> bool:
        return True

    def start_error(self, group: WorkerGroup) -> Exception | None:
        return None


@dataclass
class FakeWeights:
    """Scripted reopens and pushes; their failures go through WeightSync's own
    `failing` (a missed deadline raised as EnginesStalled, each failure recorded)."""

    world: World
    actor_version: int = 3
    served: int = 2
    pushed: list[int] = field(default_factory=list)
    sync: WeightSync = field(default_factory=lambda: WeightSync(cast(RoleGroups, None), 10))

    def reopen(self) -> None:
        with self.sync.failing():
            self.world.call("reopen")

    def push(self, version: int) -> None:
        with self.sync.failing():
            self.world.call("push")
        self.pushed.append(version)
        self.served = version

    def take_failures(self) -> list[SyncFailure]:
        return self.sync.take_failures()


@dataclass
class Listener:
    """Records what it is told; `on_rehome` may raise (an evaluation lost)."""

    told: list[tuple[str, list[int], int | None]] = field(default_factory=list)
    on_rehome: BaseException | None = None

    def forget(self, ranks: Sequence[int]) -> None:
        self.told.append(("forget", list(ranks), None))

    def rehome(self, ranks: Sequence[int], version: int) -> None:
        self.told.append(("rehome", list(ranks), version))
        if self.on_rehome is not None:
            raise self.on_rehome


@dataclass
class Machine:
    world: World
    pool: FakePool
    weights: FakeWeights
    engines: EngineMembership
    listener: Listener

    @property
    def serving(self) -> tuple[int, ...]:
        return self.pool.serving.ranks

    def lose(self, *ranks: int, call: Callable[[], Any] = lambda: "done") -> Any:
        """A call to the engines that finds `ranks` dead on its first try."""
        self.world.dead.update(ranks)
        tries = iter([RankDied("a rank died in its call")])

        def first_fails() -> Any:
            if (error := next(tries, None)) is not None:
                raise error
            return call()

        return self.engines.surviving(first_fails, "the call")


def machine(mode: Replacement, engines: int = 2, max_restarts: int = 3) -> Machine:
    world = World()
    pool = FakePool(world, engines)
    weights = FakeWeights(world)
    plan = cast(PlacementPlan, None)  # asked only by start_more, which the fake answers
    membership = EngineMembership(pool, weights, plan, WorkerSpec(Worker), mode, max_restarts,
                                  TrainerMetrics(), Timeline())  # fmt: skip
    listener = Listener()
    membership.listen(listener)
    return Machine(world, pool, weights, membership, listener)


def stuck(*ranks: int) -> EnginesStuck:
    return EnginesStuck(POOL, ranks, 5.0)


def failing_once(error: BaseException) -> Callable[[], None]:
    """A call to the engines that raises `error` the first time, then succeeds."""
    errors = [error]

    def call() -> None:
        if errors:
            raise errors.pop()

    return call


BOTH = pytest.mark.parametrize("mode", list(Replacement))


# SERVING


@BOTH
def test_serving_lost_drops_the_engine_and_the_call_is_made_again(mode: Replacement) -> None:
    m = machine(mode)
    assert m.lose(0) == "done"
    assert m.engines.trail[0] == (State.SERVING, Event.LOST)
    assert m.world.shut == [0] and m.engines.by_bundle == {slot(0): 1}
    assert m.listener.told[0] == ("forget", [0], None)
    if mode is Replacement.IN_PLACE:  # the new engine in the lost one's slot
        assert m.serving == (2, 1)
    else:  # the others go on; the new one joins later
        assert m.serving == (1,) and [g.ranks for g in m.engines.joining] == [(2,)]


@BOTH
def test_serving_stuck_drops_the_engines_without_counting_them(mode: Replacement) -> None:
    m = machine(mode)
    m.engines.surviving(failing_once(stuck(1)), "the call", Exception)
    assert m.engines.trail[0] == (State.SERVING, Event.STUCK)
    assert m.world.shut == [1] and m.engines.by_bundle == {} and m.engines.replaced == 1


def test_serving_joined_takes_the_joiners_in_and_sets_the_transfer_up_again() -> None:
    m = machine(Replacement.ELASTIC)
    m.engines.join(cast(WorkerGroup, FakeGroup(m.world, (5,), [slot(5)])))
    assert m.engines.trail == [(State.SERVING, Event.JOINED), (State.REOPENING, Event.OK),
                               (State.SETTLING, Event.OK)]  # fmt: skip
    assert m.serving == (0, 1, 5) and m.weights.pushed == []


@BOTH
def test_serving_error_with_every_engine_alive_is_the_calls_own(mode: Replacement) -> None:
    m = machine(mode)
    with pytest.raises(RankDied, match="its own"):
        m.engines.surviving(failing_once(RankDied("its own")), "the call")
    assert m.engines.trail == [] and m.world.shut == []


# REPLACING (synchronous, or fully async with no engine left)


@BOTH
def test_replacing_ok_the_replacement_serves_in_the_slot_with_the_actors_weights(
    mode: Replacement,
) -> None:
    m = machine(mode, engines=1)
    m.lose(0)
    assert (State.REPLACING, Event.OK) in m.engines.trail
    assert m.serving == (1,) and m.pool.serving.slots == [slot(0)]
    assert m.weights.pushed == [m.weights.actor_version]


@BOTH
def test_replacing_lost_a_replacement_that_dies_starting_is_replaced_in_its_slot(
    mode: Replacement,
) -> None:
    m = machine(mode, engines=1)
    m.world.on("started_up", RanksLost(Role.ROLLOUT, POOL, [1]))
    m.lose(0)
    assert (State.REPLACING, Event.LOST) in m.engines.trail
    assert m.serving == (2,) and m.world.shut == [0, 1]
    assert m.engines.by_bundle == {slot(0): 2}  # both counted in their bundle


def test_replacing_stuck_is_dropped_uncounted() -> None:
    m = machine(Replacement.IN_PLACE)
    m.world.on("started_up", stuck(1))
    m.lose(0)
    assert (State.REPLACING, Event.STUCK) in m.engines.trail
    assert m.serving == (2, 3) and m.engines.by_bundle == {slot(0): 1}


def test_replacing_not_placed_fails_the_run_naming_the_bundles() -> None:
    m = machine(Replacement.IN_PLACE)
    m.world.on("started_up", NoAnswer("rank 2 not up"))
    with pytest.raises(NotPlaced, match=r"bundles \[WorkerSlot\(pool='gen', bundle_index=0"):
        m.lose(0)
    assert m.engines.trail[-1] == (State.REPLACING, Event.NOT_PLACED)


def test_replacing_error_with_every_engine_alive_fails_the_run() -> None:
    m = machine(Replacement.IN_PLACE)
    m.world.on("started_up", ValueError("no such image"))
    with pytest.raises(ValueError, match="no such image"):
        m.lose(0)
    assert m.engines.trail[-1] == (State.REPLACING, Event.ERROR)


# REOPENING


def test_reopening_ok_goes_on_without_the_lost_engine() -> None:
    m = machine(Replacement.ELASTIC)
    m.lose(0)
    assert m.engines.trail == [(State.SERVING, Event.LOST), (State.REOPENING, Event.OK),
                               (State.SETTLING, Event.OK)]  # fmt: skip
    assert m.weights.pushed == []  # those that serve keep their weights


@BOTH
def test_reopening_lost_a_second_loss_during_a_replacement_is_dropped_too(
    mode: Replacement,
) -> None:
    m = machine(mode)
    m.world.on("reopen", RankDied("rank 1 died"))
    m.world.on("dead_ranks", None, m.world.kill(1))  # the call's look, then the reopen's
    m.lose(0)
    assert (State.REOPENING, Event.LOST) in m.engines.trail
    assert m.engines.by_bundle == {slot(0): 1, slot(1): 1}
    assert m.listener.told[-1] == ("rehome", [0, 1], m.weights.served)
    expected = {Replacement.IN_PLACE: (2, 3), Replacement.ELASTIC: (3,)}
    assert m.serving == expected[mode]


@BOTH
def test_reopening_stuck_engines_are_dropped_uncounted(mode: Replacement) -> None:
    m = machine(mode)
    m.world.on("reopen", stuck(1))
    m.lose(0)
    assert (State.REOPENING, Event.STUCK) in m.engines.trail
    assert m.engines.by_bundle == {slot(0): 1} and m.engines.replaced == 2


def test_reopening_error_with_every_engine_alive_fails_the_run() -> None:
    m = machine(Replacement.ELASTIC)
    m.world.on("reopen", ValueError("port taken"))
    with pytest.raises(ValueError, match="port taken"):
        m.lose(0)
    assert m.engines.trail[-1] == (State.REOPENING, Event.ERROR)


# RELOADING


def test_reloading_ok_pushes_the_actors_version_and_settles() -> None:
    m = machine(Replacement.IN_PLACE)
    m.lose(0)
    assert (State.RELOADING, Event.OK) in m.engines.trail
    assert m.weights.pushed == [3] and m.listener.told[-1] == ("rehome", [0], 3)


@BOTH
def test_reloading_lost_an_engine_lost_in_the_push_is_dropped(mode: Replacement) -> None:
    m = machine(mode, engines=1)
    m.world.on("push", RankDied("rank 1 died in the push"))
    m.world.on("dead_ranks", None, m.world.kill(1))  # the call's look, then the push's
    m.lose(0)
    assert (State.RELOADING, Event.LOST) in m.engines.trail
    assert m.serving == (2,) and m.engines.by_bundle == {slot(0): 2}


def test_reloading_stuck_engines_are_dropped_uncounted() -> None:
    m = machine(Replacement.IN_PLACE)
    m.world.on("push", stuck(1))
    m.lose(0)
    assert (State.RELOADING, Event.STUCK) in m.engines.trail
    assert m.serving == (2, 3) and m.engines.by_bundle == {slot(0): 1}


def test_reloading_error_with_every_engine_alive_fails_the_run() -> None:
    m = machine(Replacement.IN_PLACE)
    m.world.on("push", ValueError("a bad bucket"))
    with pytest.raises(ValueError, match="a bad bucket"):
        m.lose(0)
    assert m.engines.trail[-1] == (State.RELOADING, Event.ERROR)


# SETTLING


def test_settling_ok_gives_the_lost_engines_work_to_those_that_serve() -> None:
    m = machine(Replacement.ELASTIC)
    m.lose(0)
    assert m.engines.trail[-1] == (State.SETTLING, Event.OK)
    assert m.listener.told == [("forget", [0], None), ("rehome", [0], 2)]


@BOTH
def test_settling_lost_an_engine_found_dead_at_the_last_look_is_dropped(
    mode: Replacement,
) -> None:
    m = machine(mode)
    m.world.on("reopen", m.world.kill(1))  # dies once the transfer is set up again
    m.lose(0)
    assert (State.SETTLING, Event.LOST) in m.engines.trail
    assert m.engines.by_bundle == {slot(0): 1, slot(1): 1}


def test_settling_stuck_is_dropped_uncounted() -> None:
    m = machine(Replacement.ELASTIC)
    m.world.on("dead_ranks", None, stuck(1))  # the call's look, then SETTLING's
    m.lose(0)
    assert (State.SETTLING, Event.STUCK) in m.engines.trail
    assert m.engines.by_bundle == {slot(0): 1} and m.engines.replaced == 2


def test_settling_error_an_evaluation_that_cannot_be_asked_again_fails_the_run() -> None:
    m = machine(Replacement.IN_PLACE)
    m.listener.on_rehome = EvaluationLost("rank 0's answers")
    with pytest.raises(EvaluationLost, match="rank 0's answers"):
        m.lose(0)
    assert m.engines.trail[-1] == (State.SETTLING, Event.OK)


# Across the table


@BOTH
def test_past_the_budget_any_drop_fails_the_run_naming_the_engine(mode: Replacement) -> None:
    m = machine(mode, engines=1, max_restarts=1)
    m.world.on("started_up", RanksLost(Role.ROLLOUT, POOL, [1]))  # in the same bundle
    with pytest.raises(EngineRestartsExhausted, match=r"rank 1 on pool gen lost .* is 1"):
        m.lose(0)


@BOTH
def test_both_modes_count_a_loss_alike(mode: Replacement) -> None:
    m = machine(mode)
    m.lose(0)
    assert (m.engines.replaced, m.engines.by_bundle) == (1, {slot(0): 1})


def stalled(*ranks: int, phase: str = "bucket") -> PushFailed:
    """A push past a phase's deadline, as every actor rank raises it (push_verdict)."""
    stall = Stall(POOL, ranks, phase, 64, 256)
    return PushFailed(f"the weight push of version 3 failed: actor rank 0: {stall}")


@BOTH
def test_a_push_past_a_phases_deadline_replaces_the_engine_and_goes_on(mode: Replacement) -> None:
    """The stalled engine is taken as lost (counted in its bundle, shut down, replaced),
    the push made again, and the failed sync counted by its phase."""
    m = machine(mode)
    m.world.on("push", stalled(1))
    m.engines.surviving(lambda: m.weights.push(4), "the push", Exception)
    assert m.engines.trail[0] == (State.SERVING, Event.LOST)
    assert m.world.shut == [1] and m.engines.by_bundle == {slot(1): 1}
    assert m.weights.served == 4 and 1 not in m.serving
    failures = m.engines.metrics.registry.get_sample_value(
        "rlhf_weight_sync_failures_total", {"phase": "bucket"}
    )
    assert failures == 1
    assert m.engines.last_failed_sync == SyncFailure("bucket", str(Stall(POOL, (1,), "bucket",
                                                                         64, 256)))  # fmt: skip


def test_a_stall_while_a_loss_is_mended_is_dropped_too() -> None:
    """As the transfer is set up again after engine 0's loss, engine 1 misses the init
    deadline: it is dropped (counted) and replaced in turn; the sync counted as failed
    in its init phase."""
    m = machine(Replacement.IN_PLACE)
    m.world.on("reopen", stalled(1, phase="init"))
    m.lose(0)
    assert (State.REOPENING, Event.LOST) in m.engines.trail
    assert m.serving == (2, 3) and m.engines.by_bundle == {slot(0): 1, slot(1): 1}
    registry = m.engines.metrics.registry
    assert registry.get_sample_value("rlhf_weight_sync_failures_total", {"phase": "init"}) == 1


def test_a_stall_that_comes_back_in_its_bundle_fails_the_run_naming_it() -> None:
    """Engine 0 stalls in a push, and so does its replacement (rank 1, the same bundle)
    as it is given the weights: past maxEngineRestarts, the run fails, and the line the
    job's status gives (failure_line) names the engine, the phase and the bytes."""
    m = machine(Replacement.IN_PLACE, engines=1, max_restarts=1)
    m.world.on("push", stalled(0), stalled(1, phase="finish"))
    with pytest.raises(EngineRestartsExhausted) as failed:
        m.engines.surviving(lambda: m.weights.push(4), "the push", Exception)
    assert failure_line(failed.value).startswith(
        "EngineRestartsExhausted: rollout rank(s) 1 on pool gen missed the finish deadline "
        "of a weight sync with 64 of 256 bytes moved"
    )
    registry = m.engines.metrics.registry
    for phase in ("bucket", "finish"):
        assert registry.get_sample_value("rlhf_weight_sync_failures_total", {"phase": phase}) == 1


def test_the_table_has_a_row_for_every_event_each_state_can_meet() -> None:
    """Every transient state's work meets OK or what `classify` yields for any error."""
    group = cast(WorkerGroup, FakeGroup(World(dead={0}), (0,), [slot(0)]))
    errors = [stuck(0), RanksLost(Role.ROLLOUT, POOL, [0]), RanksLost(Role.ACTOR, POOL, [0]),
              RankDied("x"), ValueError("x"), NotPlaced("x")]  # fmt: skip
    events = {classify(error, group)[0] for error in errors} | {Event.OK}
    for state in (State.REPLACING, State.REOPENING, State.RELOADING, State.SETTLING):
        for event in events - {Event.NOT_PLACED}:
            assert (state, event) in TRANSITIONS, (state, event)
    assert (State.REPLACING, Event.NOT_PLACED) in TRANSITIONS
    assert all(state is not State.FAILED for state, _ in TRANSITIONS)
