"""Leader election through a Lease (controller/leader.py), against an in-memory API
server that keeps resourceVersions as the real one does (a stale write is a 409)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from rlhf_operator.controller import leader
from rlhf_operator.controller.leader import LeaseLock, LeaseTiming

Obj = dict[str, Any]
TIMING = LeaseTiming.scaled(15)


class FakeKube:
    def __init__(self) -> None:
        self.lease: Obj | None = None
        self.version = 0

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return copy.deepcopy(self.lease)

    def create(self, obj: Obj) -> Obj | None:
        if self.lease is not None:
            return None  # 409
        return self._store(obj)

    def replace(self, obj: Obj) -> Obj | None:
        assert self.lease is not None
        if obj["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            return None  # 409: written since it was read
        return self._store(obj)

    def _store(self, obj: Obj) -> Obj:
        self.version += 1
        self.lease = copy.deepcopy(obj)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The replicas' monotonic clock, moved by hand."""
    now = [1000.0]
    monkeypatch.setattr(leader.time, "monotonic", lambda: now[0])
    return now


def lock(kube: FakeKube, identity: str) -> LeaseLock:
    return LeaseLock(kube, "rlhf-system", "rlhf-operator", identity, TIMING)  # type: ignore[arg-type]


def test_one_replica_leads_and_the_other_waits_until_the_lease_expires(clock: list[float]) -> None:
    kube = FakeKube()
    a, b = lock(kube, "pod-a"), lock(kube, "pod-b")
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    assert a.holder() == "pod-a"
    # Renewed in time: b keeps waiting, however long it has waited in all.
    for _ in range(10):
        clock[0] += TIMING.retry
        assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    # a dies: b waits out the duration from when it last saw a renewal, on its own clock.
    clock[0] += TIMING.duration - 0.1
    assert not b.try_acquire_or_renew()
    clock[0] += 0.2
    assert b.try_acquire_or_renew() and a.holder() == "pod-b"
    assert kube.lease is not None and kube.lease["spec"]["leaseTransitions"] == 1
    # a back (a stale view): it cannot take the Lease back while b renews.
    assert not a.try_acquire_or_renew()


def test_a_released_lease_is_taken_at_once(clock: list[float]) -> None:
    kube = FakeKube()
    a, b = lock(kube, "pod-a"), lock(kube, "pod-b")
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    b.release()  # not b's to give up: nothing changes
    assert a.holder() == "pod-a"
    a.release()
    assert a.holder() == "" and b.try_acquire_or_renew() and b.holder() == "pod-b"


def test_of_two_writes_from_one_read_only_one_wins(clock: list[float]) -> None:
    kube = FakeKube()
    assert lock(kube, "pod-a").try_acquire_or_renew()
    b, c = lock(kube, "pod-b"), lock(kube, "pod-c")
    assert not b.try_acquire_or_renew() and not c.try_acquire_or_renew()
    clock[0] += TIMING.duration + 1  # a died; b and c both see it expired...
    stale = kube.get("Lease", "", "")
    assert b.try_acquire_or_renew()
    kube.get = lambda *_: copy.deepcopy(stale)  # type: ignore[method-assign]
    assert not c.try_acquire_or_renew()  # ...c read before b wrote: 409
    assert kube.lease is not None and kube.lease["spec"]["holderIdentity"] == "pod-b"


def test_the_timing_keeps_controller_runtimes_proportions() -> None:
    assert LeaseTiming.scaled(15) == LeaseTiming(15, 10, 2)
    timing = LeaseTiming.scaled(6)
    assert timing.retry < timing.renew_deadline < timing.duration


class ScriptedLock:
    """try_acquire_or_renew answers from a script: True, False, or an exception."""

    def __init__(self, *answers: bool | Exception) -> None:
        self.answers = list(answers)
        self.timing = LeaseTiming(duration=0.3, renew_deadline=0.2, retry=0.01)
        self.namespace, self.name, self.identity = "ns", "lease", "me"
        self.released = False

    def try_acquire_or_renew(self) -> bool:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def release(self) -> None:
        self.released = True


@pytest.mark.parametrize(
    ("script", "lost"),
    [
        ((False, False, True, True), False),  # waited, then leads and keeps renewing
        ((True, True, False), True),  # another replica took it: lost at once
        ((True, OSError("refused")), True),  # no renewal for renew_deadline: lost
        ((True, OSError("refused"), True), False),  # one failed renewal is not a loss
    ],
    ids=["renewing", "taken", "unreachable", "one miss"],
)
def test_a_leader_that_cannot_renew_says_it_lost_the_lease(
    script: tuple[bool | Exception, ...], lost: bool
) -> None:
    lock = ScriptedLock(*script)
    elector = leader.LeaderElector(lock)  # type: ignore[arg-type]

    async def scenario() -> None:
        await asyncio.wait_for(elector.acquire(), timeout=5)
        assert elector.leading
        await asyncio.sleep(0.5)  # past renew_deadline, many retries
        assert elector.lost.is_set() is lost and elector.leading is not lost
        await elector.release()

    asyncio.run(scenario())
    assert lock.released is not lost  # a lost Lease is not given up: it is not ours


def test_the_operator_never_runs_kopf_peering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kopf's own peering is never on (kopf.operator gets standalone=True; the Lease
    picks the leader) and its flags are gone."""
    from rlhf_operator import __main__ as entry

    seen: dict[str, Any] = {}
    monkeypatch.setattr(entry.kopf, "operator", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(entry.asyncio, "run", lambda _: None)
    entry.main(["--verbose", "-n", "a"])
    assert seen["standalone"] is True and seen["memo"].elector is None
    assert not {"peering_name", "priority"} & set(seen)
    for argv in (["--peering", "p"], ["--priority", "1"], ["--peering-lifetime", "9"],
                 ["--standalone", "--lease", "l"]):  # fmt: skip
        with pytest.raises(SystemExit):
            entry.main(argv)
