"""The rollout engines that serve, as they are lost and replaced, or join: one state
machine for both modes.

Every way an engine goes (its vLLM engine, its process, its node) reaches the driver as
a rank lost (`rollout.worker.end_rank`). Between its calls to the engines, the trainer
hands any error of theirs to `surviving`: `classify` names it an engine lost, one stuck
in a failed push's receive (NCCL's, which nothing ends from outside), or the call's own.
Every loss, in every state, takes one action, DROP: count it against
`generation.maxEngineRestarts` in its bundle (not a stuck engine), shut the engine down
for good, start a new one in its bundle, and tell the listeners to stop waiting on it.
Then the states of `TRANSITIONS` run until the engines serve again.

The modes differ in where a DROP goes. Synchronous (IN_PLACE) waits for the new engine
in the lost one's slot: it takes its predecessor's part of the batch and its seeds, so
the step's samples are the ones the lost engine would have made. Fully async (ELASTIC)
goes on with the others, the new engine joining at a later weight sync once up
(`background_starts`), and waits only when no engine is left.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, Protocol, TypeVar

from rlhf_trainer.api.config import JobConfig, Role
from rlhf_trainer.api.plan import PlacementPlan
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.hangs import NoAnswer, RankDied, RanksLost
from rlhf_trainer.cluster.placement import WorkerSlot
from rlhf_trainer.cluster.role_groups import PLACEMENT_TIMEOUT_S, WorkerSpec
from rlhf_trainer.loop.background_starts import BackgroundStarts, StartingPool
from rlhf_trainer.loop.weights import EnginesStuck, SyncFailure
from rlhf_trainer.telemetry.metrics import TrainerMetrics
from rlhf_trainer.telemetry.timeline import Timeline

log = logging.getLogger(__name__)

T = TypeVar("T")

# The timeline's marks of the rollout pool changing: the spans of the work it took.
ENGINES_LOST, ENGINES_JOINED = "engines_lost", "engines_joined"


class EngineRestartsExhausted(RuntimeError):
    """A rollout bundle lost its engine once more than `generation.maxEngineRestarts`."""


class NotPlaced(RuntimeError):
    """Replacement engines that were not up within the placement's wait."""


def check_replacements(lost: RanksLost, times_replaced: Sequence[int], limit: int) -> None:
    """Raise EngineRestartsExhausted, naming them, if any engine of `lost` is in a bundle
    whose engine was replaced `limit` times already (`times_replaced`: for each of
    lost.ranks, in order)."""
    over = [(rank, times) for rank, times in zip(lost.ranks, times_replaced, strict=True)
            if times >= limit]  # fmt: skip
    if over:
        bundles = ", ".join(f"rollout rank {rank}'s {times} time(s)" for rank, times in over)
        raise EngineRestartsExhausted(
            f"{lost}: generation.maxEngineRestarts is {limit}, and the engine in its bundle "
            f"was replaced already ({bundles})"
        )


class Replacement(Enum):
    IN_PLACE = "sync"  # wait for the new engine in the lost one's slot: its shard, its seeds
    ELASTIC = "fully async"  # go on without it; the new one joins at a weight sync

    @classmethod
    def of(cls, config: JobConfig) -> Replacement:
        return cls.ELASTIC if config.async_ is not None else cls.IN_PLACE


class State(Enum):
    SERVING = "serving"  # the trainer's calls run
    REPLACING = "replacing"  # waiting for new engines in lost ones' slots
    REOPENING = "reopening"  # the weight transfer set up again for those that serve
    RELOADING = "reloading"  # new engines that serve are pushed the actor's weights
    SETTLING = "settling"  # a last look for engines lost meanwhile
    FAILED = "failed"


class Event(Enum):
    OK = "ok"
    LOST = "lost"  # engines died (or stopped answering)
    STUCK = "stuck"  # engines alive, but stuck in a failed push's receive
    JOINED = "joined"  # engines started in the background are up
    NOT_PLACED = "not placed"  # replacements not up within the placement's wait
    ERROR = "error"  # an error with every engine alive: not a loss


class Action(Enum):
    DROP = "drop"  # count, shut down, start anew in the slot, forget: routes by mode
    DROP_UNCOUNTED = "drop, not counted"  # the same for stuck engines
    JOIN = "join"  # the joiners serve too
    ADOPT = "adopt"  # the replacements serve in their predecessors' slots
    ROUTE = "route"  # nothing; to RELOADING if new engines lack the weights, else SETTLING
    LOADED = "loaded"  # the new engines have the weights
    SETTLE = "settle"  # the lost engines' work to those that serve; counts
    RAISE = "raise"  # the error fails the run


class Route(Enum):
    BY_ACTION = "where the action says"


TRANSITIONS: dict[tuple[State, Event], tuple[Action, State | Route]] = {
    (State.SERVING, Event.LOST): (Action.DROP, Route.BY_ACTION),
    (State.SERVING, Event.STUCK): (Action.DROP_UNCOUNTED, Route.BY_ACTION),
    (State.SERVING, Event.JOINED): (Action.JOIN, State.REOPENING),
    (State.SERVING, Event.ERROR): (Action.RAISE, State.FAILED),
    (State.REPLACING, Event.OK): (Action.ADOPT, State.REOPENING),
    (State.REPLACING, Event.LOST): (Action.DROP, Route.BY_ACTION),
    (State.REPLACING, Event.STUCK): (Action.DROP_UNCOUNTED, Route.BY_ACTION),
    (State.REPLACING, Event.NOT_PLACED): (Action.RAISE, State.FAILED),
    (State.REPLACING, Event.ERROR): (Action.RAISE, State.FAILED),
    (State.REOPENING, Event.OK): (Action.ROUTE, Route.BY_ACTION),
    (State.REOPENING, Event.LOST): (Action.DROP, Route.BY_ACTION),
    (State.REOPENING, Event.STUCK): (Action.DROP_UNCOUNTED, Route.BY_ACTION),
    (State.REOPENING, Event.ERROR): (Action.RAISE, State.FAILED),
    (State.RELOADING, Event.OK): (Action.LOADED, State.SETTLING),
    (State.RELOADING, Event.LOST): (Action.DROP, Route.BY_ACTION),
    (State.RELOADING, Event.STUCK): (Action.DROP_UNCOUNTED, Route.BY_ACTION),
    (State.RELOADING, Event.ERROR): (Action.RAISE, State.FAILED),
    (State.SETTLING, Event.OK): (Action.SETTLE, State.SERVING),
    (State.SETTLING, Event.LOST): (Action.DROP, Route.BY_ACTION),
    (State.SETTLING, Event.STUCK): (Action.DROP_UNCOUNTED, Route.BY_ACTION),
    (State.SETTLING, Event.ERROR): (Action.RAISE, State.FAILED),
}


class LossListener(Protocol):
    """Told of engines lost (Evaluator; fully_async.Admissions)."""

    def forget(self, ranks: Sequence[int]) -> None:
        """At a drop: wait no more on what the engines of `ranks` were doing."""

    def rehome(self, ranks: Sequence[int], version: int) -> None:
        """Once the engines serve again, on policy `version`: the work of the engines of
        `ranks` to those that serve."""


class RolloutPool(StartingPool, Protocol):
    """What the membership needs of RoleGroups (a fake in tests/unit)."""

    def __getitem__(self, role: Role) -> WorkerGroup: ...
    def replace(self, group: WorkerGroup) -> None: ...
    def started_up(self, groups: Sequence[WorkerGroup], timeout_s: float) -> WorkerGroup: ...


class Weights(Protocol):
    """What the membership needs of WeightSync."""

    actor_version: int
    served: int

    def reopen(self) -> None: ...
    def push(self, version: int) -> None: ...
    def take_failures(self) -> list[SyncFailure]: ...


def classify(
    error: BaseException, serving: WorkerGroup, dropped: Sequence[int] = ()
) -> tuple[Event, RanksLost | None]:
    """What an error of a call to the engines means: engines stuck, engines lost (named
    by the error, or found dead now), replacements not placed, or the call's own.
    Engines `dropped` already (their replacements awaited) are not lost again."""
    if isinstance(error, NotPlaced):
        return Event.NOT_PLACED, None
    if isinstance(error, RanksLost):  # named by the error (another role's: not a loss)
        ranks = [rank for rank in error.ranks if rank not in dropped]
        if error.role != Role.ROLLOUT or not ranks:
            return Event.ERROR, None
        if isinstance(error, EnginesStuck):  # DROP skips those dropped already
            return Event.STUCK, error
        whole = len(ranks) == len(error.ranks)  # then its own words (EnginesStalled's)
        return Event.LOST, error if whole else RanksLost(Role.ROLLOUT, error.pool, ranks)
    dead = [rank for rank in serving.dead_ranks() if rank not in dropped]
    if isinstance(error, Exception) and dead:
        return Event.LOST, RanksLost(Role.ROLLOUT, serving.pool, dead)
    return Event.ERROR, None


class EngineMembership:
    """Who serves (the group RoleGroups holds, which the weight transfer reads), who is
    starting, the restart budget, and the one way engines leave and come back."""

    def __init__(
        self,
        pool: RolloutPool,
        weights: Weights,
        plan: PlacementPlan,
        worker: WorkerSpec,
        replacement: Replacement,
        max_restarts: int,
        metrics: TrainerMetrics,
        timeline: Timeline,
    ) -> None:
        self.pool = pool
        self.weights = weights
        self.plan = plan
        self.worker = worker  # the engines' (a toy engine's in tests)
        self.replacement = replacement
        self.max_restarts = max_restarts
        self.metrics = metrics
        self.timeline = timeline
        self.listeners: list[LossListener] = []
        self.replaced = 0  # engines, in this run
        self.by_bundle: Counter[WorkerSlot] = Counter()  # the replacements in each bundle
        self.starts = BackgroundStarts(pool, plan, worker)  # ELASTIC
        # One recovery's: replacements waited for, engines lost, new ones to load.
        self.awaiting: list[WorkerGroup] = []
        self.lost: list[int] = []
        self.unloaded: list[int] = []
        self.trail: list[tuple[State, Event]] = []  # the rows the last run took
        self.last_failed_sync: SyncFailure | None = None
        self.count()

    @property
    def serving(self) -> WorkerGroup:
        return self.pool[Role.ROLLOUT]

    def listen(self, listener: LossListener) -> None:
        self.listeners.append(listener)

    def surviving(
        self, call: Callable[[], T], what: str, lost_in: type[BaseException] = RankDied
    ) -> T:
        """`call` to the engines, made again after every loss of engines it meets, once
        they serve again. `lost_in`: the errors that may mean an engine was lost (a push
        fails with the transfer's own error, or a peer's); any other is raised, and so
        is one with every engine alive."""
        while True:
            try:
                return call()
            except lost_in as error:
                self.count_failed_syncs()
                event, lost = classify(error, self.serving)
                if TRANSITIONS[(State.SERVING, event)][0] is Action.RAISE:
                    raise
            self.recover(event, lost)
            log.warning("%s failed on the engine(s) lost; again on those that serve", what)

    def drop_dead(self) -> None:
        """Drop the engines that died since the last look, if any."""
        if dead := self.serving.dead_ranks():
            self.recover(Event.LOST, RanksLost(Role.ROLLOUT, self.serving.pool, dead))

    def recover(self, event: Event, lost: RanksLost | None) -> None:
        """From engines lost (or stuck) while serving, until the engines serve again."""
        with self.timeline.span(self.serving.pool, Role.ROLLOUT, ENGINES_LOST):
            self.run(event, lost)

    def join(self, joining: WorkerGroup) -> None:
        """Take the engines of `joining` in (between the trainer's calls to the engines)."""
        with self.timeline.span(self.serving.pool, Role.ROLLOUT, ENGINES_JOINED):
            self.run(Event.JOINED, joining)
        log.info("rollout rank(s) %s joined: %d engine(s) serve",
                 list(joining.ranks), self.serving.world_size)  # fmt: skip

    def run(self, event: Event, detail: Any) -> None:
        """TRANSITIONS from SERVING on `event`, until SERVING again (or an error)."""
        self.awaiting, self.lost, self.unloaded, self.trail = [], [], [], []
        state = State.SERVING
        while True:
            self.trail.append((state, event))
            action, target = TRANSITIONS[(state, event)]
            routed = self.act(action, detail)
            state = routed if target is Route.BY_ACTION else target
            if state is State.SERVING:
                return
            event, detail = self.enter(state)

    def count_failed_syncs(self) -> None:
        """rlhf_weight_sync_failures_total{phase}; the last one logged and kept."""
        for failure in self.weights.take_failures():
            self.metrics.observe_sync_failure(failure.phase)
            self.last_failed_sync = failure
            log.warning("%s", failure.line)

    def enter(self, state: State) -> tuple[Event, Any]:
        """The state's one call to the engines, and what came of it."""
        try:
            if state is State.REPLACING:
                return Event.OK, self.wait_for_replacements()
            if state is State.REOPENING:
                self.weights.reopen()
            elif state is State.RELOADING:
                self.weights.push(self.weights.actor_version)
            elif dead := [r for r in self.serving.dead_ranks() if r not in self.lost]:  # SETTLING
                return Event.LOST, RanksLost(Role.ROLLOUT, self.serving.pool, dead)
            return Event.OK, None
        except Exception as error:
            self.count_failed_syncs()  # a reopen's or a push's
            event, lost = classify(error, self.serving, self.lost)
            return event, error if event in (Event.ERROR, Event.NOT_PLACED) else lost

    def act(self, action: Action, detail: Any) -> State:
        """Do `action`; returns where it routes (used for Route.BY_ACTION)."""
        if action is Action.RAISE:
            raise detail if isinstance(detail, BaseException) else RuntimeError(detail)
        if action in (Action.DROP, Action.DROP_UNCOUNTED):
            return self.drop(detail, counted=action is Action.DROP)
        if action is Action.JOIN:
            self.pool.replace(self.serving.joined(detail))
        elif action is Action.ADOPT:
            self.pool.replace(self.serving.substituted(detail))
            self.awaiting, self.unloaded = [], [*self.unloaded, *detail.ranks]
            log.info("rollout rank(s) %s serve in place of those lost", list(detail.ranks))
        elif action is Action.LOADED:
            self.unloaded = []
        elif action is Action.SETTLE:
            self.settle()
        return State.RELOADING if self.unloaded else State.SETTLING

    def drop(self, lost: RanksLost, counted: bool) -> State:
        """DROP: the engines of `lost` (serving, or replacements that died starting)
        counted against their bundles' budget, shut down for good (one that only stopped
        answering must not come back), new ones started in their slots, and the
        listeners told. Returns REPLACING (synchronous, or none left), else REOPENING."""
        serving = self.serving
        where = self.slots_of(lost.ranks)
        if not where:  # none of them serves or starts: not the membership's to mend
            raise RuntimeError(f"{lost}, but none of them serves or starts")
        if set(where) != set(lost.ranks):  # else in its own words (EnginesStalled's)
            lost = RanksLost(Role.ROLLOUT, lost.pool, list(where))
        self.count_lost(lost, [where[rank] for rank in lost.ranks], counted)
        gone = serving.without(serving.without(list(where)).ranks)
        starting = [group for group in self.awaiting if set(group.ranks) & set(where)]
        for group in [gone, *starting]:
            group.shutdown(grace_s=0)
        slots = [*gone.slots, *(slot for group in starting for slot in group.slots)]
        started = self.pool.respawn(Role.ROLLOUT, slots, self.worker)
        self.awaiting = [group for group in self.awaiting if group not in starting]
        self.lost += where
        remaining = serving.without(self.lost)  # those lost before stay, to be substituted
        if self.replacement is Replacement.IN_PLACE or self.awaiting or not remaining.ranks:
            self.awaiting += started  # the lost stay in the group, to be substituted
            next_state = State.REPLACING
        else:
            self.pool.replace(remaining)
            self.start_background(started)
            next_state = State.REOPENING
        log.warning("%s: new engines start in their bundles (%d replaced in this run)%s",
                    lost, self.replaced, "; waiting for them" if self.awaiting else "")  # fmt: skip
        for listener in self.listeners:
            listener.forget(list(where))
        return next_state

    def slots_of(self, ranks: Sequence[int]) -> dict[int, WorkerSlot]:
        """The slots of the engines of `ranks` that serve or are being waited for (not
        those dropped already in this recovery)."""
        groups = [self.serving, *self.awaiting]
        return {rank: g.slots[g.ranks.index(rank)] for g in groups for rank in ranks
                if rank in g.ranks and rank not in self.lost}  # fmt: skip

    def count_lost(self, lost: RanksLost, slots: list[WorkerSlot], counted: bool) -> None:
        """Count the engines of `lost` as replaced; past generation.maxEngineRestarts in
        any one bundle, EngineRestartsExhausted naming them (and nothing counted).
        Engines stuck in a push that another's loss failed are not counted against it."""
        if counted:
            check_replacements(lost, [self.by_bundle[slot] for slot in slots], self.max_restarts)
            self.by_bundle.update(slots)
        self.replaced += len(slots)

    def wait_for_replacements(self) -> WorkerGroup:
        """The replacements, once up; RanksLost naming those that died starting."""
        try:
            return self.pool.started_up(self.awaiting, PLACEMENT_TIMEOUT_S)
        except NoAnswer as error:
            slots = [slot for group in self.awaiting for slot in group.slots]
            raise NotPlaced(
                f"the engines started in the bundles {slots} of those lost were not up "
                f"within {PLACEMENT_TIMEOUT_S:g} s: {error}"
            ) from error

    def settle(self) -> None:
        """The lost engines' work to those that serve (on the version they serve)."""
        if self.lost:
            for listener in self.listeners:
                listener.rehome(self.lost, self.weights.served)
            log.warning("rollout rank(s) %s lost: %d engine(s) serve", self.lost,
                        self.serving.world_size)  # fmt: skip
        self.count()

    def start_background(self, groups: Sequence[WorkerGroup]) -> None:
        """ELASTIC: engines to take in once they are up (`ready_to_join`)."""
        self.starts.add(groups)
        self.count()

    @property
    def joining(self) -> list[WorkerGroup]:
        """ELASTIC: the engines starting in the background."""
        return self.starts.joining

    def ready_to_join(self) -> WorkerGroup | None:
        """ELASTIC: the engines started in the background that are up, as one group (None
        if none is). Starts engines on the pool's free GPUs first, if there are any, and
        again in the slots of those that could not start, once their wait is over."""
        self.start_background(self.starts.more())
        up = self.starts.up()
        self.start_background(self.starts.retried())
        return up

    def count(self) -> None:
        """rlhf_rollout_engines: serving, lost in the run, and joining."""
        serving = self.serving
        self.metrics.observe_engines(serving.pool, serving.world_size, self.replaced,
                                     joining=self.starts.count())  # fmt: skip
