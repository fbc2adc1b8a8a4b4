"""The GPU shapes of a job, proven on CPU through vLLM's own code: every tensor-parallel
engine is configured, placed on its bundles and ranked in the weight transfer as it would
be on a GPU node.

What runs as it is: our plan, slots and rank environment (`role_slots`,
`engine_environment`, `WorkerSlot.process_gpus`), our engine settings; vLLM's
`EngineArgs.create_engine_config` and `Executor.get_class`; vLLM's Ray executor
(`RayExecutorV2`) from its start to the first answer it awaits from a worker; vLLM's NCCL
payload and worker rank arithmetic (`worker_init_payload`, `worker_init_process_group`)
and our fan-out of it; our transfer choice.

STAND-INS, for what this machine has not (nothing else is faked):
- CUDA: vLLM's current platform (the CPU build's) answers `is_cuda()` True,
  `is_cpu()` False, `ray_device_key` "GPU", `get_device_total_memory()` 80 GiB, and `device_count()` with what Ray shows the rank's process:
  one GPU to a process that asks a share of one, every GPU of its node to a process that
  asks none (Ray 2.60 then leaves CUDA_VISIBLE_DEVICES as it is).
- Ray, under vLLM's Ray executor: `StandInRay` records the options of each worker actor
  and ends the start at the executor's first `ray.get`; the placement group's table puts
  the pool's bundles on its nodes as PACK does (a node's GPUs, node after node).
- NCCL: vLLM's `stateless_init_process_group` records the rank and world each worker
  would join with, instead of opening a communicator.
"""

from __future__ import annotations

import os
import types
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlhf_operator.api.validation import parse_job
from rlhf_trainer.api.config import Device, JobConfig, Role
from rlhf_trainer.api.plan import PlacementPlan, plan_placement, roles_with_processes
from rlhf_trainer.api.transfer import Backend, choose_transfer, nccl_ranks
from rlhf_trainer.cluster.placement import (
    WorkerSlot,
    engine_environment,
    rank_order,
    role_slots,
)
from rlhf_trainer.rollout.engine_settings import (
    engine_settings,
    executor_backend,
    memory_budget,
    transfer_reserve_bytes,
)
from tests.specs import job_config
from tests.unit.conftest import EXAMPLES, load

TENSOR_PARALLEL = (1, 2, 4, 8)
PIPELINE_PARALLEL = (1, 2)  # in the transfer's ranks: workers per engine = TP x PP
TRAINER = {"batchSize": 840, "miniBatchSize": 840}  # divisible by every rank count 1-8
GPU_BYTES = 80 * 2**30
GPU_MEMORY_UTILIZATION = 0.5


def colocated(gpus: int, tp: int) -> JobConfig:
    """Every role on one node of `gpus` GPUs: gpus / tp engines beside gpus actor ranks."""
    pool = [{"name": "all", "gpusPerNode": gpus}]
    roles = {r: "all" for r in ("actor", "rollout", "ref", "critic", "reward")}
    return job_config(pool, roles, generation={"tensorParallelSize": tp}, trainer=TRAINER)


def split(actor_gpus: int, engines: int, tp: int) -> JobConfig:
    """Actor ranks on one pool, `engines` engines of `tp` GPUs on another (one node of
    them all where they fit in 8 GPUs, else one engine a node)."""
    one_node = engines * tp <= 8
    generate = {"name": "generate", "replicas": 1 if one_node else engines,
                "gpusPerNode": engines * tp if one_node else tp}  # fmt: skip
    pools = [{"name": "train", "gpusPerNode": actor_gpus}, generate]
    roles = {"actor": "train", "ref": "train", "critic": "train", "reward": "train",
             "rollout": "generate"}  # fmt: skip
    return job_config(pools, roles, generation={"tensorParallelSize": tp}, trainer=TRAINER)


def matrix() -> Iterator[tuple[str, JobConfig]]:
    for gpus in range(1, 9):
        for tp in TENSOR_PARALLEL:
            if gpus % tp == 0:
                yield f"colocated-{gpus}gpu-tp{tp}", colocated(gpus, tp)
    for actor_gpus in range(1, 9):
        for engines in range(1, 5):
            for tp in TENSOR_PARALLEL:
                yield f"split-{actor_gpus}actor-{engines}x{tp}", split(actor_gpus, engines, tp)


def examples() -> Iterator[tuple[str, JobConfig]]:
    for path in EXAMPLES:
        yield path.name, parse_job(load(path)).spec.job_config()  # what the trainer gets


SHAPES = dict(matrix()) | dict(examples())


def pool_nodes(config: JobConfig, pool: str) -> list[str]:
    """The node of each bundle of the pool, as PACK places them: node after node."""
    spec = config.pool(pool)
    return [f"{pool}-node{i // spec.gpus_per_node}" for i in range(spec.total_gpus)]


def slots(config: JobConfig, plan: PlacementPlan, role: Role) -> list[WorkerSlot]:
    return role_slots(plan, role, rank_order(pool_nodes(config, plan.roles[role].pool)))


def visible_gpus(config: JobConfig, slot: WorkerSlot) -> int:
    """What Ray shows the rank's process (see the stand-ins above)."""
    return config.pool(slot.pool).gpus_per_node if slot.process_gpus == 0 else 1


# --- placement: bundles, GPU shares and the transfer, for every shape -------------


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_engine_owns_its_bundles_on_one_node(name: str) -> None:
    config = SHAPES[name]
    plan = plan_placement(config)
    rollout = plan.roles[Role.ROLLOUT]
    tp = rollout.tensor_parallel_size
    engines = slots(config, plan, Role.ROLLOUT)
    nodes = pool_nodes(config, rollout.pool)
    owned = [slot.engine_bundles or (slot.bundle_index,) for slot in engines]
    assert [len(bundles) for bundles in owned] == [tp] * rollout.data_parallel_size
    assert sorted(b for bundles in owned for b in bundles) == list(range(rollout.gpus))
    for slot, bundles in zip(engines, owned, strict=True):
        assert bundles[0] == slot.bundle_index  # its process sits in its first bundle
        assert len({nodes[b] for b in bundles}) == 1, f"{slot} spans nodes"
        environment = engine_environment(slot)
        if tp == 1:
            assert environment == {} and slot.process_gpus == slot.gpu_share
        else:
            assert environment["VLLM_RAY_BUNDLE_INDICES"] == ",".join(map(str, bundles))
            assert float(environment["VLLM_RAY_PER_WORKER_GPUS"]) == slot.gpu_share
            assert slot.process_gpus == 0


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_what_each_bundle_is_asked_for_fits_its_gpu(name: str) -> None:
    """Every process and vLLM worker on a bundle asks Ray for its share; together at most
    the bundle's one GPU (else Ray never places the last of them), and the rollout takes
    one share of every bundle of its engines."""
    config = SHAPES[name]
    plan = plan_placement(config)
    asked: defaultdict[tuple[str, int], float] = defaultdict(float)
    for role in roles_with_processes(plan):
        for slot in slots(config, plan, role):
            asked[slot.pool, slot.bundle_index] += slot.process_gpus
            for bundle in slot.engine_bundles:  # vLLM's workers, at the pool's share
                asked[slot.pool, bundle] += slot.gpu_share
    over = {bundle: gpus for bundle, gpus in asked.items() if gpus > 1 + 1e-9}
    assert not over, f"bundles asked for more than one GPU: {over}"
    rollout = slots(config, plan, Role.ROLLOUT)
    taken = Counter(b for s in rollout for b in s.engine_bundles or (s.bundle_index,))
    assert set(taken.values()) == {1}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_ipc_serves_an_engine_only_where_an_actor_rank_shares_each_gpu(name: str) -> None:
    """vLLM's IPC engine opens, in each worker, the handle made on that worker's own GPU
    by an actor rank: each of an engine's bundles must hold an actor rank."""
    config = SHAPES[name]
    if config.pool(config.roles.rollout).device is Device.CPU:
        pytest.skip("a CPU pool: the host transfer, no GPU")
    plan = plan_placement(config)
    transfer = choose_transfer(config, cuda=True)
    actor_bundles = {(s.pool, s.bundle_index) for s in slots(config, plan, Role.ACTOR)}
    engine_bundles = {
        (s.pool, b)
        for s in slots(config, plan, Role.ROLLOUT)
        for b in s.engine_bundles or (s.bundle_index,)
    }
    assert (transfer.backend is Backend.IPC) == (engine_bundles <= actor_bundles)


# --- the NCCL group: vLLM's worker rank arithmetic --------------------------------


@pytest.fixture
def recorded_ranks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """What each worker would join vLLM's NCCL group with (the stand-in for NCCL)."""
    from vllm.distributed.weight_transfer import nccl_common

    joined: list[tuple[int, int]] = []

    def record(address: str, port: int, rank: int, world: int, device: Any) -> None:
        joined.append((rank, world))

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", record)
    monkeypatch.setattr("torch.accelerator.current_device_index", lambda: 0)
    return joined


def engine_payloads(engines: int, workers: int) -> tuple[int, list[dict[str, Any]]]:
    """The sender's world, and what our fan-out hands each engine of vLLM's payload."""
    from vllm.distributed.weight_transfer.nccl_common import (
        NCCLWeightTransferInitInfo,
        worker_init_payload,
    )

    from rlhf_trainer.rollout.transfer_engines import trainer_init_info
    from rlhf_trainer.rollout.weight_sync import TransferSetup
    from tests.unit.test_nccl_ranks import Recorder

    setup = TransferSetup("127.0.0.1", 29500, engines, (), 1, 10.0, "nccl", workers)
    world = trainer_init_info(0, setup).world_size
    payload = worker_init_payload(
        NCCLWeightTransferInitInfo(
            master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=world
        )
    )
    fan_out = Recorder(engines, workers)
    fan_out.init_weight_transfer_engine(payload)
    return world, fan_out.sent


@pytest.mark.parametrize("pp", PIPELINE_PARALLEL)
@pytest.mark.parametrize("tp", TENSOR_PARALLEL)
@pytest.mark.parametrize("engines", [1, 2, 3, 4])
def test_every_worker_of_every_engine_gets_its_own_nccl_rank(
    engines: int, tp: int, pp: int, recorded_ranks: list[tuple[int, int]]
) -> None:
    from vllm.distributed.weight_transfer.nccl_common import (
        NCCLWeightTransferInitInfo,
        worker_init_process_group,
    )

    from tests.unit.test_nccl_ranks import EngineParallel

    workers = tp * pp
    world, sent = engine_payloads(engines, workers)
    assert world == nccl_ranks(engines, workers).world_size == 1 + engines * workers
    for payload in sent:
        for rank in range(workers):  # vLLM's rank within the engine: TP x PP workers
            info = NCCLWeightTransferInitInfo(**payload)
            worker_init_process_group(info, EngineParallel(rank, workers))
    assert sorted(rank for rank, _ in recorded_ranks) == list(range(1, world))
    assert {w for _, w in recorded_ranks} == {world}


# --- the engine: vLLM's configuration and its Ray executor ------------------------


class StandInRay:
    """Ray, as vLLM's Ray executor sees it, on the nodes of one pool: it records each
    worker actor's options, and the executor's first `ray.get` (the workers' GPU ids)
    ends the start with `Started`."""

    class Started(Exception):
        pass

    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.workers: list[dict[str, Any]] = []
        self.util = types.SimpleNamespace(get_node_ip_address=lambda: "127.0.0.1")

    def is_initialized(self) -> bool:
        return True

    def get_runtime_context(self) -> Any:
        return types.SimpleNamespace(get_node_id=lambda: self.nodes[0], runtime_env=None)

    def alive_nodes(self) -> list[dict[str, Any]]:
        return [{"NodeID": n, "NodeManagerAddress": n, "Alive": True} for n in set(self.nodes)]

    def table(self, group: Any) -> dict[str, Any]:
        return {
            "bundles_to_node_id": dict(enumerate(self.nodes)),
            "bundles": dict(enumerate(group.bundle_specs)),
        }

    def remote(self, actor_class: Any) -> Any:
        stand_in = self

        class Options:
            def options(self, **options: Any) -> Any:
                stand_in.workers.append(options)
                # the worker's one method called before the executor's first ray.get
                asked = types.SimpleNamespace(remote=lambda: None)
                worker = types.SimpleNamespace(get_node_and_physical_gpu_ids=asked)
                return types.SimpleNamespace(remote=lambda **_: worker)

        return Options()

    def get(self, _: Any) -> Any:
        raise self.Started()


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model's config that every tensor-parallel size of the matrix divides (8 heads);
    a configuration needs no weights. Its architecture's module is imported now, while
    vLLM's platform is still the CPU's (with CUDA stood in it would import CUDA kernels)."""
    import vllm.model_executor.models.qwen2  # noqa: F401
    from transformers import Qwen2Config

    directory = tmp_path_factory.mktemp("engine-model")
    Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                architectures=["Qwen2ForCausalLM"]).save_pretrained(directory)  # fmt: skip
    return directory


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """vLLM's platform as CUDA's (the stand-in above); the environment as it was after."""
    from vllm.platforms import current_platform

    saved = dict(os.environ)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "ray_device_key", "GPU")
    monkeypatch.setattr(current_platform, "get_device_total_memory", lambda: GPU_BYTES)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def build_engine(
    model: Path, config: JobConfig, slot: WorkerSlot, cuda: pytest.MonkeyPatch
) -> tuple[Any, StandInRay]:
    """The engine of `slot` as its rank builds it: our settings in the environment the
    placement gives the rank, vLLM's config, and vLLM's executor started on the pool's
    placement group. Returns vLLM's config and what its executor asked of Ray."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.executor import ray_executor_v2, ray_utils
    from vllm.v1.executor.abstract import Executor

    from rlhf_trainer.cluster.placement import pool_bundles

    cuda.setattr(current_platform, "device_count", lambda: visible_gpus(config, slot))
    os.environ.update(engine_environment(slot))
    settings = engine_settings(
        model, max_model_len=128, gpu_memory_utilization=GPU_MEMORY_UTILIZATION, seed=0,
        dtype="bfloat16",
        tensor_parallel_size=config.generation.tensor_parallel_size,
        enforce_eager=config.generation.enforce_eager,
        transfer_backend=choose_transfer(config, cuda=True).backend.value,
    )  # fmt: skip
    vllm_config = EngineArgs(**settings).create_engine_config()
    ray = StandInRay(pool_nodes(config, slot.pool))
    plan = plan_placement(config)
    pool = next(p for p in plan.pools if p.name == slot.pool)
    group = types.SimpleNamespace(bundle_specs=pool_bundles(pool), id=None)
    vllm_config.parallel_config.placement_group = group  # the rank's, in a Ray actor
    if vllm_config.parallel_config.distributed_executor_backend == "ray":
        for module in (ray_utils, ray_executor_v2):
            cuda.setattr(module, "ray", types.SimpleNamespace(
                is_initialized=ray.is_initialized, get_runtime_context=ray.get_runtime_context,
                util=ray.util, nodes=ray.alive_nodes, remote=ray.remote, get=ray.get))  # fmt: skip
        cuda.setattr(ray_utils, "placement_group_table", ray.table)
        executor = Executor.get_class(vllm_config).__new__(Executor.get_class(vllm_config))
        with pytest.raises(StandInRay.Started):
            executor.__init__(vllm_config)
        executor._finalizer.detach()  # its shutdown would kill the stand-in's actors
    return vllm_config, ray


def engine_shapes() -> dict[str, JobConfig]:
    """Each example with tensor parallelism, and a colocated and a split node of 8 GPUs
    at every TP."""
    shapes = {name: c for name, c in examples() if c.generation.tensor_parallel_size > 1}
    shapes |= {f"colocated-8gpu-tp{tp}": colocated(8, tp) for tp in TENSOR_PARALLEL}
    return shapes | {f"split-8actor-2x{tp}": split(8, 2, tp) for tp in TENSOR_PARALLEL}


ENGINE_SHAPES = engine_shapes()


def first_and_last_engine() -> Iterator[tuple[str, int]]:
    for name, config in sorted(ENGINE_SHAPES.items()):
        engines = plan_placement(config).roles[Role.ROLLOUT].data_parallel_size
        yield from ((name, index) for index in sorted({0, engines - 1}))


@pytest.mark.parametrize(("name", "engine"), list(first_and_last_engine()))
def test_vllm_builds_each_engine_on_its_own_bundles(
    name: str, engine: int, engine_model: Path, cuda: pytest.MonkeyPatch
) -> None:
    config = ENGINE_SHAPES[name]
    slot = slots(config, plan_placement(config), Role.ROLLOUT)[engine]
    tp = config.generation.tensor_parallel_size
    vllm_config, ray = build_engine(engine_model, config, slot, cuda)
    parallel = vllm_config.parallel_config
    assert parallel.world_size == parallel.tensor_parallel_size == tp
    assert vllm_config.model_config.enforce_eager is False  # CUDA graphs, by default
    # vLLM's share counts the NCCL receiver's buffers (2 x 1 GiB); IPC maps the sender's
    buffers = 2 / 80 if choose_transfer(config, cuda=True).backend is Backend.NCCL else 0
    budget = vllm_config.cache_config.gpu_memory_utilization
    assert budget == pytest.approx(GPU_MEMORY_UTILIZATION - buffers)
    if tp == 1:
        assert parallel.distributed_executor_backend == "uni"
        assert ray.workers == []  # the model runs in the engine's own process
        return
    assert parallel.distributed_executor_backend == "ray"
    placed = [w["scheduling_strategy"].placement_group_bundle_index for w in ray.workers]
    assert placed == list(slot.engine_bundles)
    assert [w["num_gpus"] for w in ray.workers] == [slot.gpu_share] * tp


def test_a_budget_that_leaves_vllm_nothing_beside_the_transfers_buffers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"gpuMemoryUtilization 0.1 leaves vLLM nothing "
                       r"beside the weight transfer's 2.0 GiB of buffers on a 24.0 GiB GPU"):  # fmt: skip
        memory_budget(0.1, transfer_reserve_bytes("nccl"), 24 * 2**30)
    assert memory_budget(0.9, transfer_reserve_bytes("ipc"), 24 * 2**30) == 0.9


def test_an_engine_outside_a_placement_leaves_the_executor_to_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the bundles a rank is given, vLLM chooses (and checks the node's devices)."""
    monkeypatch.delenv("VLLM_RAY_BUNDLE_INDICES", raising=False)
    assert executor_backend(2, cuda=True) is None
    assert executor_backend(2, cuda=False) == "mp"
    assert executor_backend(1, cuda=True) == "uni"
    monkeypatch.setenv("VLLM_RAY_BUNDLE_INDICES", "2,3")
    assert executor_backend(2, cuda=True) == "ray"
