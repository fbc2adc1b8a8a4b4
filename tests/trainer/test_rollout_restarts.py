"""When a rollout engine is restarted, without vLLM: one restart however many callers
see the engine die, at most `limit` of them, and a call waiting on a dead engine gives
up. (test_rollout_vllm.py kills a real engine; test_async_loop.py and test_ppo_loop.py
kill one in the middle of a run.)"""

from __future__ import annotations

import asyncio
import logging

import pytest

from rlhf_trainer.rollout.engine_restart import (
    EngineDied,
    EngineRecovery,
    EngineRestartsExhausted,
    until_dead,
)

NAME = "rollout rank 3 (pool rollout)"


class Engine:
    """Stands for the engine: counts its restarts, each taking a moment."""

    def __init__(self, fail: bool = False) -> None:
        self.builds = 0
        self.fail = fail

    async def restart(self) -> None:
        await asyncio.sleep(0.01)
        if self.fail:
            raise RuntimeError("no memory for a new engine")
        self.builds += 1


def recovery(engine: Engine, limit: int) -> EngineRecovery:
    return EngineRecovery(NAME, limit, engine.restart, lambda: 12)


def test_many_callers_seeing_one_death_make_one_restart(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    health = recovery(engine, limit=3)

    async def callers() -> None:
        dead = EngineDied("gone")
        await asyncio.gather(*(health.recover(dead, generation=0) for _ in range(50)))

    with caplog.at_level(logging.WARNING):
        asyncio.run(callers())
    assert engine.builds == health.restarts == health.generation == 1
    assert len(health.seconds) == 1
    died = "vLLM engine died (EngineDied('gone')); restart 1 of 3, reloading policy version 12"
    assert f"{NAME}: {died}" in caplog.text


def test_a_caller_that_saw_a_replaced_engine_die_does_not_restart_the_new_one() -> None:
    engine = Engine()
    health = recovery(engine, limit=3)

    async def late() -> None:
        await health.recover(EngineDied(), generation=0)
        await health.recover(EngineDied(), generation=0)  # late news of engine 0
        await health.settled()

    asyncio.run(late())
    assert engine.builds == health.restarts == 1


def test_past_the_limit_a_death_is_an_error_naming_the_engine() -> None:
    engine = Engine()
    health = recovery(engine, limit=2)

    async def deaths() -> None:
        for generation in range(3):
            await health.recover(EngineDied(), generation)

    with pytest.raises(EngineRestartsExhausted, match=r"rollout rank 3 \(pool rollout\).*is 2"):
        asyncio.run(deaths())
    assert engine.builds == health.restarts == 2


def test_with_no_restarts_allowed_the_first_death_fails() -> None:
    engine = Engine()
    with pytest.raises(EngineRestartsExhausted, match="after 0 restart"):
        asyncio.run(recovery(engine, limit=0).recover(EngineDied(), 0))
    assert engine.builds == 0
    with pytest.raises(ValueError):
        recovery(engine, limit=-1)


def test_an_engine_that_cannot_be_restarted_fails_at_its_first_death_saying_why() -> None:
    """With vLLM's NCCL or IPC transfer the weights never pass through the engine's
    process: its first death is the error, whatever maxEngineRestarts allows, and no new
    engine is built (on a GPU that would take minutes, and memory, for nothing)."""
    engine = Engine()
    why = "it cannot be restarted: with the nccl weight transfer ..."
    health = EngineRecovery(NAME, 3, engine.restart, lambda: 12, unrestartable=why)
    with pytest.raises(EngineRestartsExhausted) as died:
        asyncio.run(health.recover(EngineDied("gone"), generation=0))
    assert str(died.value) == f"{NAME}: vLLM engine died (EngineDied('gone')); {why}"
    assert engine.builds == health.restarts == 0


def test_a_failed_restart_fails_its_waiters_and_counts() -> None:
    health = recovery(Engine(fail=True), limit=3)

    async def callers() -> list[BaseException | None]:
        return await asyncio.gather(
            *(health.recover(EngineDied(), 0) for _ in range(3)), return_exceptions=True
        )

    outcomes = asyncio.run(callers())
    assert all(isinstance(o, RuntimeError) and "no memory" in str(o) for o in outcomes)
    assert (health.restarts, health.generation) == (1, 0)


def test_a_call_waiting_on_an_engine_that_dies_gives_up() -> None:
    async def wait_forever() -> None:
        await asyncio.Event().wait()  # a utility call whose answer never comes

    async def dies_after(seconds: float) -> None:
        started = asyncio.get_running_loop().time()

        def errored() -> bool:
            return asyncio.get_running_loop().time() - started > seconds

        await until_dead(wait_forever(), errored)

    with pytest.raises(EngineDied):
        asyncio.run(asyncio.wait_for(dies_after(0.2), timeout=10))

    async def answers() -> int:
        await asyncio.sleep(0.01)
        return 7

    async def alive() -> int:
        return await until_dead(answers(), lambda: False)

    assert asyncio.run(alive()) == 7
