"""A rank lost for memory is reported as out of memory, naming the rank, its pool, its
call and the figure, not as Ray's bare "actor died" (`cluster.hangs.rank_died`).

The errors are Ray's and torch's own classes, with the texts they carry: torch's CPU
allocator's is raised here for real; Ray's memory monitor's and a SIGKILLed worker's
were captured from Ray 2.60 on this machine (a Ray actor grown past a low
RAY_memory_usage_threshold, and one killed with SIGKILL); CUDA's is torch's format (no
GPU here)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import ray
import torch
from ray.core.generated.common_pb2 import ActorDiedErrorContext

from rlhf_trainer.cluster.hangs import RankCall, RankOutOfMemory, rank_died, record

# Ray 2.60's memory monitor (the first line of its OutOfMemoryError; the rest is advice).
MEMORY_MONITOR = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node "
    "(IP: 192.0.2.2, ID: 5ca1f628b3f631aa359d1ec29dfea65b264ae7e10d8da105c9e0cc84) was "
    "9.23GB used / 23.54GB limit (0.392163)\nOOM kill reason: Memory usage 9920200704B "
    "exceeded threshold of 9908262912B (39.2% of 25276182528B limit)\n"
)
# A worker killed with SIGKILL: Ray 2.60's ActorDiedErrorContext.error_message.
KILLED = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
    "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of "
    "file. Some common causes include: (1) the process was killed by the OOM killer due to "
    "high memory usage, (2) ray stop --force was called, or (3) the worker crashed "
    "unexpectedly due to SIGSEGV or another unexpected error."
)
CUDA = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 "
    "GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 "
    "GiB memory in use."
)


@dataclass(frozen=True)
class Ref:
    """Stands in for a Ray ObjectRef: the registry of calls knows a call by its id."""

    id: bytes

    def binary(self) -> bytes:
        return self.id


def a_call(method: str) -> Ref:
    ref = Ref(method.encode())
    record(ref, RankCall("actor", "policy", 3, method, host=None))  # type: ignore[arg-type]
    return ref


def host_out_of_memory() -> RuntimeError:
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as error:
        return error
    raise AssertionError("allocated 4 EiB")


def test_a_rank_killed_by_rays_memory_monitor_is_out_of_the_nodes_memory() -> None:
    error = rank_died(a_call("update"), ray.exceptions.OutOfMemoryError(MEMORY_MONITOR))
    assert isinstance(error, RankOutOfMemory)
    assert str(error) == (
        "actor rank 3 on pool policy (update) ran out of memory: Ray's memory monitor killed "
        "its process (9.23GB used / 23.54GB limit on node 192.0.2.2)"
    )


@pytest.mark.parametrize(
    ("raised", "figure"),
    [
        (torch.OutOfMemoryError(CUDA), "Tried to allocate 2.00 GiB. GPU 0 has a total "
         "capacity of 79.19 GiB of which 1.06 GiB is free."),
        (host_out_of_memory(), "can't allocate memory: you tried to allocate "
         "4611686018427387904 bytes"),
    ],
    ids=["cuda", "host"],
)  # fmt: skip
def test_a_call_that_runs_out_of_a_gpus_or_the_hosts_memory_says_so(
    raised: Exception, figure: str
) -> None:
    error = rank_died(a_call("log_probs"), ray.exceptions.RayTaskError("log_probs", "", raised))
    assert isinstance(error, RankOutOfMemory)
    assert str(error).startswith("actor rank 3 on pool policy (log_probs) ran out of memory: ")
    assert figure in str(error)


def test_a_rank_killed_without_a_word_is_said_to_have_ended_abruptly_naming_its_node() -> None:
    context = ActorDiedErrorContext(error_message=KILLED, class_name="RankHost",
                                    actor_id=b"\1" * 16, pid=9516, node_ip_address="10.1.2.3")  # fmt: skip
    error = rank_died(a_call("update"), ray.exceptions.ActorDiedError(context))
    assert type(error).__name__ == "RankDied"
    assert str(error) == (
        "actor rank 3 on pool policy (update) died: its process ended abruptly (killed, "
        "crashed or exited; if killed, the kernel's OOM killer is the usual cause: see the "
        "kernel log on 10.1.2.3)"
    )


def test_any_other_death_keeps_rays_first_line() -> None:
    error = rank_died(a_call("update"), ray.exceptions.ActorDiedError())
    assert str(error) == (
        "actor rank 3 on pool policy (update) died: "
        "The actor died unexpectedly before finishing this task."
    )
