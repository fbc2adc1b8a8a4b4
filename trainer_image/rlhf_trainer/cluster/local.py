"""Connecting to a Ray cluster: the KubeRay one a RayJob starts, or a simulated one on
this machine shaped like the job's pools."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlhf_trainer.api.agents import AgentConfig
from rlhf_trainer.api.config import Device, JobConfig
from rlhf_trainer.api.names import POOL_LABEL, pool_resource

# No log monitor: the driver is not sent the workers' output (log_to_driver=False); their
# logs are still written to Ray's session folder.
QUIET_NODE = {"include_log_monitor": False}


def connect_to_cluster() -> None:
    """Join the Ray cluster named by RAY_ADDRESS (a RayJob sets it for its driver)."""
    import ray

    ray.init()


@dataclass(frozen=True)
class LocalCluster:
    """The simulated cluster a local run trains on."""

    address: str
    cluster: Any  # ray.cluster_utils.Cluster
    config: JobConfig
    gpus: MachineGpus  # the CUDA devices its nodes take

    def add_node(self, pool: str) -> None:
        """One more node of `pool`, as the operator makes it (a bigger `replicas`, or a
        pod that replaces a lost one)."""
        with self.gpus.for_node(self.config, pool):
            self.cluster.add_node(**pool_node(self.config, pool))

    def kill_node(self, node_id: str) -> None:
        """SIGKILL the node's raylet and every process on it, without warning (a lost
        pod or machine); Ray finds it dead by its health checks.

        The workers the raylet started (and their children, a vLLM engine core) are
        stopped first and killed after it: a worker would otherwise go on until it
        noticed its raylet gone, and might still answer a call (a weight push) meanwhile."""
        import psutil  # type: ignore[import-untyped]

        (node,) = [n for n in self.cluster.list_all_nodes() if n.node_id == node_id]
        if node is self.cluster.head_node:
            raise ValueError(
                f"node {node_id} is the first pool's first node, which also holds Ray's "
                "head (its GCS) on this machine: killing it would end the cluster"
            )
        (raylet,) = node.all_processes["raylet"]
        workers = psutil.Process(raylet.process.pid).children(recursive=True)
        signal_all(workers, "suspend")
        self.cluster.remove_node(node, allow_graceful=False)
        signal_all(workers, "kill")


def pool_node(config: JobConfig, pool: str) -> dict[str, Any]:
    """Ray's arguments for a node of `pool`: the logical GPUs, the pool resource and the
    pool label the operator gives the real nodes."""
    (gpus,) = [p.gpus_per_node for p in config.pools if p.name == pool]
    return {
        "num_cpus": 1,
        "num_gpus": gpus,
        "resources": {pool_resource(pool): gpus},
        "labels": {POOL_LABEL: pool},
        **QUIET_NODE,
    }


# Ray reads this variable when a node starts and refuses a node with more GPUs than it
# lists, so an empty one ("hide the GPUs") would refuse every simulated node.
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


class MachineGpus:
    """This machine's CUDA devices, handed out to the simulated nodes: each node of a GPU
    pool starts with devices of its own in CUDA_VISIBLE_DEVICES, from which Ray gives its
    workers theirs, so two nodes never share a GPU. Without CUDA (`ids` empty) the nodes'
    GPUs are logical, Ray's resources alone, and the roles compute on CPU: whatever
    CUDA_VISIBLE_DEVICES says (unset, empty, or ids that are not there), the nodes start
    without it and their workers are given it empty (`worker_environment`)."""

    def __init__(self, ids: list[str]) -> None:
        self.cuda = bool(ids)
        self.free = list(ids)  # handed out first to last; a node's stay taken

    @classmethod
    def of_this_machine(cls) -> MachineGpus:
        """The devices torch sees: none where CUDA_VISIBLE_DEVICES hides them (`rlhfjob
        train --cpu` sets it empty) or names none that exist."""
        import torch

        if not torch.cuda.is_available():
            return cls([])
        visible = os.environ.get(VISIBLE_DEVICES)
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        return cls(ids[: torch.cuda.device_count()])

    def worker_environment(self) -> dict[str, str]:
        """What every worker of the cluster is started with: on CPUs, no device visible,
        so torch and vLLM in a worker never take a GPU the machine may have (Ray keeps a
        worker's own CUDA_VISIBLE_DEVICES, narrowing the logical GPU it assigns to none)."""
        return {} if self.cuda else {VISIBLE_DEVICES: ""}

    @contextmanager
    def for_node(self, config: JobConfig, pool: str) -> Iterator[None]:
        """CUDA_VISIBLE_DEVICES set, while a node of `pool` starts, to the devices it
        takes; without CUDA, unset while it starts (the node's GPUs are logical)."""
        if not self.cuda:
            with environment_variable(VISIBLE_DEVICES, None):
                yield
            return
        spec = config.pool(pool)
        if spec.device == Device.CPU:
            raise ValueError(
                f"pools[{pool}].device is cpu, but this machine has CUDA: a local run cannot "
                "keep one pool off its GPUs; run every pool on CPUs with `rlhfjob train "
                "--cpu`, or give the pool device: gpu"
            )
        if spec.gpus_per_node > len(self.free):
            raise ValueError(
                f"pools[{pool}] needs {spec.gpus_per_node} GPUs for a node, and this "
                f"machine has {len(self.free)} left of its CUDA devices: a local run gives "
                "every node GPUs of its own (`rlhfjob train --cpu` runs it on CPUs)"
            )
        taken, self.free = self.free[: spec.gpus_per_node], self.free[spec.gpus_per_node :]
        with environment_variable(VISIBLE_DEVICES, ",".join(taken)):
            yield


@contextmanager
def environment_variable(name: str, value: str | None) -> Iterator[None]:
    """`name` set to `value` (None: unset) until the block ends, then put back."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def local_agent(agent: AgentConfig) -> contextlib.AbstractContextManager[str]:
    """The agent given by its function, served on this machine (`python -m rlhf_env
    agent`), taking as many episodes at once as the trainer sends it."""
    from rlhf_env.process import served_locally

    episodes = ["--max-episodes", str(agent.max_concurrent_episodes)]
    return served_locally(agent.serve or "", episodes, command="agent")


def local_gateways(config: JobConfig) -> dict[str, str]:
    """With generation.agent, where the engines' gateways listen (rollout.agent_shared):
    on loopback, where the local agents run, each on a free port (the simulated nodes
    share this host, so GATEWAY_PORT would clash)."""
    from rlhf_trainer.rollout.agent_shared import GATEWAY_HOST_VARIABLE, GATEWAY_PORT_VARIABLE

    if config.generation.agent is None:
        return {}
    return {GATEWAY_HOST_VARIABLE: "127.0.0.1", GATEWAY_PORT_VARIABLE: "0"}


def signal_all(processes: list[Any], how: str) -> None:
    """psutil's `how` ("suspend", "kill") on each of `processes` that still lives."""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            getattr(process, how)()


@contextmanager
def local_environments(config: JobConfig) -> Iterator[JobConfig]:
    """The job with each environment it names by class (`serve`), and each agent it names
    by function, served on this machine until the block ends, and its url filled in
    (rlhf_env.process): every one declared, so each that a data row names is. A chat
    template kept in a ConfigMap is refused first: a local run has none to mount."""
    from rlhf_env.process import served_locally

    # The server's deadlines are the episodes', as the operator gives its pods.
    episodes = config.multi_turn
    if episodes is not None and episodes.chat_template_from is not None:
        ref = episodes.chat_template_from.config_map_key_ref
        raise ValueError(
            f"generation.multiTurn.chatTemplateFrom: a local run has no ConfigMap to read key "
            f"{ref.key!r} of {ref.name!r} from: give the template inline, as "
            "multiTurn.chatTemplate"
        )
    deadlines = (
        ["--call-seconds", str(episodes.tool_call_timeout_seconds),
         "--idle-seconds", str(episodes.episode_timeout_seconds)]
        if episodes is not None else []
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        environments = [
            environment
            if environment.serve is None
            else environment.model_copy(
                update={
                    "url": stack.enter_context(served_locally(environment.serve, deadlines)),
                    "serve": None,
                }
            )
            for environment in config.environments
        ]
        agents = [
            agent
            if agent.serve is None
            else agent.model_copy(
                update={"url": stack.enter_context(local_agent(agent)), "serve": None}
            )
            for agent in config.agents
        ]
        yield config.model_copy(update={"environments": environments, "agents": agents})


@contextmanager
def local_ray_cluster(config: JobConfig) -> Iterator[LocalCluster]:
    """A simulated Ray cluster on this machine shaped like the job's pools; yields it
    once connected. One node per pool replica (`pool_node`).

    Ray's head is the first pool's first node, not a node of its own as the operator's
    head pod is: a run here has no head pod's work to place (its driver is this
    process), and a node costs a raylet and two agents (measured: 3-5 CPU-s less a run,
    and the cluster up 1.5-5 s sooner). So that node cannot be killed (`kill_node`)."""
    import ray
    from ray.cluster_utils import Cluster

    # No dashboard and no idle workers started ahead: on a laptop both only take CPU
    # from the roles' start-up (measured: the head starts in 4.5 s instead of 7). No
    # autoscaler (nodes are added here) and no log monitors (QUIET_NODE): a cluster then
    # stops in 0.4 s, not 1.4.
    first, *others = [pool.name for pool in config.pools for _ in range(pool.replicas)]
    gpus = MachineGpus.of_this_machine()
    with gpus.for_node(config, first):
        cluster = Cluster(
            initialize_head=True,
            head_node_args=pool_node(config, first)
            | {
                "include_dashboard": False,
                "no_monitor": True,
                "_system_config": {
                    "enable_worker_prestart": False,
                    # Nor the worker Ray starts ahead for the first driver: on CPUs the
                    # run's workers take a runtime env of their own (`worker_environment`),
                    # which that one lacks, so it stayed idle (~0.5 CPU-s of every start,
                    # bench/overhead/startup.py).
                    "prestart_worker_first_driver": False,
                    # A node killed is found dead in about 3 s, not 15 or more.
                    "health_check_period_ms": 1000,
                    "health_check_failure_threshold": 3,
                },
            },
        )
    local = LocalCluster(str(cluster.address), cluster, config, gpus)
    try:
        for pool_name in others:
            local.add_node(pool_name)
        # Ray's INFO lines here say where a dashboard is (there is none) in ANSI colours,
        # even into a pipe: a local run's output stays plain without them.
        workers = gpus.worker_environment() | local_gateways(config)
        ray.init(
            address=cluster.address,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
            runtime_env={"env_vars": workers} if workers else None,
        )
        yield local
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
