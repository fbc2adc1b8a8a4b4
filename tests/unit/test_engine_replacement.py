"""Rollout engines lost are replaced in their bundles (`loop.membership`): how
many times a bundle's engine may be replaced, and where a replacement goes. The
replacement itself, with Ray and vLLM, is test_ppo_loop.py's split run."""

from __future__ import annotations

import pytest

from rlhf_trainer.api.config import Role
from rlhf_trainer.cluster.groups import WorkerGroup
from rlhf_trainer.cluster.hangs import RanksLost
from rlhf_trainer.cluster.placement import WorkerSlot
from rlhf_trainer.loop.membership import EngineRestartsExhausted, check_replacements


def lost(*ranks: int) -> RanksLost:
    return RanksLost(Role.ROLLOUT, "gen", ranks)


def test_a_bundles_engine_is_replaced_up_to_the_limit_then_its_loss_is_named() -> None:
    check_replacements(lost(0), [0], limit=3)
    check_replacements(lost(1, 2), [2, 0], limit=3)
    with pytest.raises(EngineRestartsExhausted) as raised:
        check_replacements(lost(4, 5), [3, 1], limit=3)
    assert str(raised.value) == (
        "rollout rank 4 on pool gen, rollout rank 5 on pool gen lost (killed, its node lost, "
        "or silent 60 s): generation.maxEngineRestarts is 3, and the engine in its bundle "
        "was replaced already (rollout rank 4's 3 time(s))"
    )
    with pytest.raises(EngineRestartsExhausted, match="maxEngineRestarts is 0"):
        check_replacements(lost(0), [0], limit=0)


def test_a_replacement_takes_the_place_of_the_rank_in_its_slot() -> None:
    """Its place in the group is its part of the batch, and so its seeds."""
    slots = [WorkerSlot("gen", index, 1.0) for index in range(3)]
    group = WorkerGroup(Role.ROLLOUT, slots, ["host0", "host1", "host2"], [])
    assert group.slots_of([2, 1]) == [slots[2], slots[1]]
    new = WorkerGroup(Role.ROLLOUT, [slots[1]], ["host3"], [], ranks=[3])
    replaced = group.substituted(new)
    assert replaced.ranks == (0, 3, 2)
    assert replaced.hosts == ("host0", "host3", "host2")
    assert replaced.slots == group.slots
    assert replaced.slots_of([3]) == [slots[1]]
