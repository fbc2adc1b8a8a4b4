"""kopf registration. kopf watches, peers and runs the event loop; it writes nothing.

Every event about a job or one of its children (found by the job label) is kept in a
cache (the reconcile reads from it) and puts the job's key on a work queue (a child's,
only while the cache holds its job); workers take keys and run one level-based
reconcile each. No finalizers (deleting a job never waits for the operator) and no
timers: a deleted child, a pod becoming ready or KubeRay updating its RayJob is itself
an event.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
from aiohttp import web

from rlhf_operator.api import job as api
from rlhf_operator.app import metrics
from rlhf_operator.controller.cache import CachedKube, ObjectCache
from rlhf_operator.controller.kube import KINDS, load_config
from rlhf_operator.controller.leader import LeaderElector
from rlhf_operator.controller.reconcile import CHILD_REQUESTS, Reconciler
from rlhf_operator.controller.relist import Relister, Relists
from rlhf_operator.controller.workqueue import Key, WorkQueue
from rlhf_operator.render.children import JOB_LABEL
from rlhf_operator.render.network import NetworkAccess

log = logging.getLogger("rlhf_operator")

# Reconciles wait on the API server, not the CPU: enough threads to keep it busy.
WORKERS = int(os.environ.get("RLHF_OPERATOR_WORKERS", "8"))
HEALTH_PORT = int(os.environ.get("RLHF_OPERATOR_HEALTH_PORT", "8080"))
RETRY_SECONDS = (1, 2, 5, 10, 30, 60)  # backoff of a job whose reconcile keeps failing

# Children whose changes the job must react to (all carry the job label).
CHILD_KINDS = [
    ("", "v1", "pods"),
    ("", "v1", "configmaps"),
    ("", "v1", "serviceaccounts"),
    ("rbac.authorization.k8s.io", "v1", "roles"),
    ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("ray.io", "v1", "rayjobs"),
    # Each operator-run environment's; a job's own policy too (render_job_policy).
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("policy", "v1", "poddisruptionbudgets"),  # an environment's with several replicas
]
KIND_OF = {kind.plural: name for name, kind in KINDS.items()}  # "pods" -> "Pod"
CACHED_KINDS = frozenset({"RLHFJob", *(KIND_OF[plural] for _, _, plural in CHILD_KINDS)})
# What each kind's watch handler takes, as a label selector (relist.py lists the same).
SELECTORS = {"RLHFJob": "", **{KIND_OF[plural]: JOB_LABEL for _, _, plural in CHILD_KINDS}}
# The chart's networkPolicy values: its peers if enabled, the cluster's ranges always.
NETWORK = NetworkAccess.from_env()


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf builds each object's essence (a deep copy of its body) at every event, for
    change handlers to diff; the operator has none, only event handlers. Under a burst
    of new jobs that copying was about 9% of the operator's busy samples (py-spy), CPU
    that the API server on the same machine was short of."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        pass


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf starts its watches only once this returns: a replica that waits to lead
    (memo.elector, leader.py) waits here, serving its probes and metrics meanwhile."""
    settings.posting.level = logging.WARNING  # our own Events say what users need
    # No watching of CRDs and namespaces for changes: that would need cluster-wide read
    # access to both, which least privilege does not give (KubeRay comes first anyway).
    settings.scanning.disabled = True
    # The work queue already merges bursts of events per job; kopf need not wait for more.
    settings.batching.batch_window = 0.01
    settings.persistence.diffbase_storage = NoDiffBase()
    select_children(settings)
    memo.queue = WorkQueue()
    # Filled by the handlers below before they queue a job: reconciles read from it.
    memo.cache = ObjectCache(CACHED_KINDS)
    kube = CachedKube(load_config(connections=WORKERS + CHILD_REQUESTS), memo.cache)
    memo.reconciler = Reconciler(kube, network=NETWORK)
    memo.gauges = metrics.JobGauges()
    memo.failures = {}
    memo.executor = ThreadPoolExecutor(WORKERS, thread_name_prefix="reconcile")
    await _serve_probes(memo)
    elector: LeaderElector | None = memo.get("elector")
    if elector is not None:
        await elector.acquire()
        memo.lease_watch = asyncio.create_task(_exit_when_lost(elector))
    # KubeRay's version, said at once; each job's own fields are checked before its RayJob.
    loop = asyncio.get_running_loop()
    problem = await loop.run_in_executor(memo.executor, memo.reconciler.kuberay.problem, {})
    if problem is not None:
        log.warning("%s; jobs wait (Pending, KubeRayIncompatible) until it is", problem)
    memo.workers = [asyncio.create_task(_work(memo)) for _ in range(WORKERS)]
    relister = Relister(kube, memo.cache, SELECTORS)
    memo.relists = Relists(relister, memo.executor, memo.queue.add)
    memo.relist_period = asyncio.create_task(memo.relists.every())


def select_children(settings: kopf.OperatorSettings) -> None:
    """The API server, not the handlers, drops the children kinds' objects that carry no
    job label: kopf lists and watches a kind whole otherwise, and with 10,000 unrelated
    pods and as many ConfigMaps the operator's RSS was 447 MB (bench-operator)."""
    for group, version, plural in CHILD_KINDS:
        settings.watching.label_selectors[group, version, plural] = JOB_LABEL


async def _serve_probes(memo: kopf.Memo) -> None:
    """/healthz: the workers (none while a standby waits to lead) are alive; /readyz: and
    the API server answers (a standby is ready to take over)."""

    async def alive() -> bool:
        return not any(worker.done() for worker in memo.get("workers", []))

    async def ready() -> bool:
        loop = asyncio.get_running_loop()
        reachable = await loop.run_in_executor(memo.executor, memo.reconciler.kube.reachable)
        return await alive() and bool(reachable)

    app = metrics.health_app(is_alive=alive, is_ready=ready)
    memo.http = web.AppRunner(app, access_log=None)
    await memo.http.setup()
    await web.TCPSite(memo.http, "0.0.0.0", HEALTH_PORT).start()


async def _exit_when_lost(elector: LeaderElector) -> None:
    """A leader that cannot renew its Lease stops at once, before a standby may take it
    (controller-runtime exits too): reconciles under way in threads would go on through
    a graceful stop. The Deployment starts it again, as a standby."""
    await elector.lost.wait()
    logging.shutdown()
    os._exit(1)


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    for task in [*memo.get("workers", []), memo.get("relist_period")]:
        if task is not None:
            task.cancel()
    if "relists" in memo:
        memo.relists.close()
    if "executor" in memo:
        memo.executor.shutdown(wait=False, cancel_futures=True)
    elector: LeaderElector | None = memo.get("elector")
    if elector is not None and await _reconciles_ended(memo):
        await elector.release()  # the standby takes over at once, not a Lease later
    if "http" in memo:
        await memo.http.cleanup()


async def _reconciles_ended(memo: kopf.Memo, timeout: float = 10) -> bool:
    """Whether the reconciles under way ended within `timeout` seconds: until they do,
    the Lease stays held (it expires if they never do)."""
    executors = [memo.executor, memo.reconciler.fanout]
    try:
        async with asyncio.timeout(timeout):
            for executor in executors:
                await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)
    except TimeoutError:
        log.warning("reconciles still under way after %ss: the Lease is left to expire", timeout)
        return False
    return True


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)  # type: ignore[arg-type]
async def job_changed(event: kopf.RawEvent, name: str, namespace: str, memo: kopf.Memo,
                      **_: Any) -> None:  # fmt: skip
    memo.cache.observe("RLHFJob", event["type"], event["object"])
    if event["type"] is None:  # a listing's: it says nothing of what went in a gap
        memo.relists.ask_all()
    if event["type"] == "DELETED":
        memo.gauges.observe(namespace, name, None)
    else:  # a job with no status yet is new: its RayJob is still to be made
        memo.queue.add((namespace, name), urgent=not event["object"].get("status"))


def child_changed(kind: str) -> Any:
    async def changed(event: kopf.RawEvent, labels: kopf.Labels, namespace: str,
                      memo: kopf.Memo, **_: Any) -> None:  # fmt: skip
        memo.cache.observe(kind, event["type"], event["object"])
        if event["type"] is None:  # a listing's: it says nothing of what went in a gap
            memo.relists.ask_all()
        # Only a job the cache holds: its own events bring the rest (its listing at
        # start-up, its creation), and once it is deleted its children's going needs
        # no reconcile (each would ask the API server for the job again).
        if memo.cache.holds("RLHFJob", namespace, labels[JOB_LABEL]):
            memo.queue.add((namespace, labels[JOB_LABEL]))

    return changed


for _group, _version, _plural in CHILD_KINDS:
    kopf.on.event(_group, _version, _plural, labels={JOB_LABEL: kopf.PRESENT},
                  id=f"child-{_plural}")(child_changed(KIND_OF[_plural]))  # fmt: skip


async def _work(memo: kopf.Memo) -> None:
    queue: WorkQueue = memo.queue
    while True:
        key = await queue.get()
        metrics.QUEUE_DEPTH.set(len(queue))
        started = time.perf_counter()
        try:
            loop = asyncio.get_running_loop()
            result = await loop.run_in_executor(memo.executor, memo.reconciler.reconcile, *key)
            memo.gauges.observe(*key, result.status)
            memo.failures.pop(key, None)
            if result.report_later:
                queue.add(key)  # at normal priority: after the new jobs that wait
            if result.requeue_after is not None:
                queue.add_later(key, max(result.requeue_after, 0.1))
        except Exception:
            _retry_later(memo, key)
        finally:
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
            queue.done(key)


def _retry_later(memo: kopf.Memo, key: Key) -> None:
    attempt = memo.failures[key] = memo.failures.get(key, 0) + 1
    delay = RETRY_SECONDS[min(attempt, len(RETRY_SECONDS)) - 1]
    log.exception("reconcile of %s/%s failed (attempt %d); retry in %ds", *key, attempt, delay)
    metrics.RECONCILE_ERRORS.inc()
    memo.queue.add_later(key, delay)
