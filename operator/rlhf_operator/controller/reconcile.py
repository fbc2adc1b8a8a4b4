"""Level-based reconcile of one RLHFJob: make the children match the spec, then report.

Called with a job's key whenever anything about the job or its children changed; it
reads the current state each time (from the watches' cache, controller/cache.py), so a
missed or repeated call does no harm.
It is the only writer of the job's status (except `training`, the trainer's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from rlhf_operator.api.job import Phase, RLHFJobSpec, RLHFJobStatus
from rlhf_operator.api.validation import InvalidJob, parse_spec
from rlhf_operator.controller.attempts import sync_rayjob, sync_workload
from rlhf_operator.controller.drift import OWNED_FIELDS, drifted
from rlhf_operator.controller.events import EventRecorder
from rlhf_operator.controller.heads import observe_head, record_patch, workers_of_a_lost_head
from rlhf_operator.controller.kube import Kube, Obj
from rlhf_operator.controller.kuberay import RECHECK_SECONDS, KubeRayCheck, ask_head
from rlhf_operator.controller.report import (
    driver_restart_message,
    invalid_message,
    phase_message,
    status_patch,
)
from rlhf_operator.controller.resizes import (
    ResizeAction,
    decide_resize,
    stop_asked,
    stop_asked_patch,
)
from rlhf_operator.controller.restarts import (
    LATE_VERDICT,
    Action,
    as_the_ray_job_ended,
    counted,
    decide,
    head_job_url,
    late_verdict,
)
from rlhf_operator.controller.status import (
    KUBERAY_INCOMPATIBLE,
    Observed,
    blocked_status,
    compute_status,
    finished,
    invalid_status,
    reported_to_the_end,
    warnings,
)
from rlhf_operator.render.agents import render_stopped_agents
from rlhf_operator.render.children import JOB_LABEL, JobRef, render_children
from rlhf_operator.render.environments import render_stopped_environments
from rlhf_operator.render.network import NetworkAccess
from rlhf_trainer.api.progress import PoolResize

log = logging.getLogger(__name__)

WARNING_PHASES = (Phase.FAILED,)
DRIVER_RESTARTED = "DriverRestarted"  # the Warning of a Ray head lost inside an attempt
CHILD_REQUESTS = 8  # requests for jobs' children in flight at once, over all reconciles


WAITING = (Action.RECORD, Action.WAIT)  # a failed attempt waits out the backoff
# A queued job's Kueue Workload carries no job label, so no event tells of its changes
# (its reason while it waits): look again this often. Admission is an event (the RayJob).
QUEUED_RECHECK_SECONDS = 15.0


@dataclass(frozen=True)
class Reconciled:
    status: RLHFJobStatus | None  # None: the job is gone
    requeue_after: float | None = None  # seconds: nothing else will bring the job back
    # A new job's RayJob was made; its RoleBindings and report (Event, status) wait for
    # the next pass, which the queue gives a lower priority than other new jobs' first.
    report_later: bool = False


class JobGone(Exception):
    """The job was deleted while its reconcile ran (its children are being collected)."""


class ChildConflict(RuntimeError):
    """A child's name is taken by an object this job does not own."""


class Reconciler:
    def __init__(
        self,
        kube: Kube,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        network: NetworkAccess | None = None,
        ask_head: Callable[[str], Obj] = ask_head,
    ):
        self.kube = kube
        self.ask_head = ask_head  # GET a Ray head's job API (a URL) -> its JSON answer
        self.now = now
        self.network = network  # give each job a NetworkPolicy (the chart's choice)
        self.kuberay = KubeRayCheck(kube)
        self.events = EventRecorder(kube, now)
        self.fanout = ThreadPoolExecutor(CHILD_REQUESTS, thread_name_prefix="children")
        # Jobs whose children this process made but for their RoleBindings, and whose
        # first report is still to come. They are no longer new: their children may have
        # been collected since.
        self._unreported: set[tuple[str, str]] = set()

    def reconcile(self, namespace: str, name: str) -> Reconciled:
        """Bring one job to its desired state; returns its new status, and when to look
        again if no event will say (a failed attempt's backoff)."""
        try:
            result = self._reconcile(namespace, name)
        except JobGone:
            result = Reconciled(None)
        if not result.report_later:
            self._unreported.discard((namespace, name))
        return result

    def _reconcile(self, namespace: str, name: str) -> Reconciled:
        job = self.kube.get("RLHFJob", namespace, name)
        if job is None or job["metadata"].get("deletionTimestamp"):
            return Reconciled(None)  # the garbage collector removes the children
        meta = job["metadata"]
        generation = meta.get("generation")
        old = RLHFJobStatus.model_validate(job.get("status") or {})
        try:
            spec = parse_spec(job.get("spec"))
        except InvalidJob as invalid:
            # Admission normally stops this; if it slips through, say so and create nothing.
            new = invalid_status(old, generation, str(invalid).replace("\n", "; "), self.now())
            self._write_status(job, old, new)
            return Reconciled(new)

        ref, now = JobRef(name, namespace, meta["uid"]), self.now()
        # A job whose status was never written is new: it has no RayJob unless this
        # process made one (the cache holds what it made), so a miss is not asked about.
        # Were one there, its create would answer 409 and _ensure reads it.
        new_job = not job.get("status") and (namespace, name) not in self._unreported
        get_rayjob = self.kube.known if new_job else self.kube.get
        rayjob = get_rayjob("RayJob", namespace, ref.rayjob)
        if late_verdict(rayjob) and not finished(old) and not counted(old, rayjob):
            rayjob = self._as_the_ray_job_ended(ref, rayjob)
        # A finished job is not started again; a failed attempt may be (restarts.py), and
        # one whose pools changed size is replaced (resizes.py).
        restart = None if finished(old) else decide(spec.restart_policy, rayjob, old, now)
        resize = None
        if restart is not None and restart.action is Action.NONE:
            resize = decide_resize(spec, rayjob, old.training)
        workload, live = None, None
        binding: list[Future[Obj | None]] = []  # RoleBindings being made
        if resize is not None and resize.action is ResizeAction.REPLACE and rayjob is not None:
            # As for a restart, the deletion's event brings the reconcile that creates
            # the next attempt, with the spec's sizes. Asked once: KubeRay's finalizer
            # keeps the RayJob a while, through more events.
            if "deletionTimestamp" not in rayjob["metadata"]:
                log.info("replacing RayJob %s/%s for a resize: %s", namespace, ref.rayjob,
                         resize.resizes)  # fmt: skip
                self.kube.delete("RayJob", namespace, ref.rayjob, uid=rayjob["metadata"]["uid"])
        elif restart is not None and restart.action is Action.NONE:
            # Children wiped after a deletion the cache has not heard of yet (the garbage
            # collector's work) are not made again. A new job had none to wipe.
            if rayjob is None and not new_job and self._gone(ref):
                raise JobGone(name)
            children = render_children(ref, spec, self.network)
            # Before anything is created: a KubeRay that would drop fields (or cannot
            # probe the pods) would leave the job waiting for ever.
            blocked = self.kuberay.problem(children[-1]) if rayjob is None else None
            if blocked is not None:
                new = blocked_status(old, generation, KUBERAY_INCOMPATIBLE, blocked, now)
                self._write_status(job, old, new)
                return Reconciled(new, requeue_after=RECHECK_SECONDS)
            unbound = (namespace, name) in self._unreported
            rayjob, live, binding = self._ensure_children(
                ref, spec, children, rayjob, new_job, unbound
            )
            if resize is not None and resize.action is ResizeAction.WAIT and rayjob is not None:
                rayjob = self._ask_stop(ref, rayjob, resize.resizes)
            workload = sync_workload(self.kube, spec, rayjob)
        elif finished(old):
            stopped = render_stopped_environments(ref, spec) + render_stopped_agents(ref, spec)
            live = self._ensure_all(ref, stopped)
        elif restart is not None and restart.action is Action.DELETE and restart.failure:
            # Its deletion is an event: the reconcile it brings creates the next attempt.
            self.kube.delete("RayJob", namespace, ref.rayjob, uid=restart.failure.ray_job_uid)
        observed = self._observe(ref, spec, rayjob, workload, live, old)
        new = compute_status(spec, generation, observed, old, now, restart, resize)
        if new_job and rayjob is not None:
            # Its RayJob first: in a burst of new jobs, the API server makes the other
            # jobs' RayJobs before it takes this one's RoleBinding, Event and status.
            self._unreported.add((namespace, name))
            for made in binding:  # any (its RayJob was made before, by this process)
                made.result()
            return Reconciled(new, report_later=True)
        if new.driver_restarts > old.driver_restarts:
            self._replace_workers_of_the_lost_head(ref, observed, new)
        self._write_status(job, old, new)
        for made in binding:  # the pass ends once they are made (or raises as they did)
            made.result()
        wait = restart.wait_seconds if restart and restart.action in WAITING else None
        if new.phase is Phase.QUEUED:
            wait = QUEUED_RECHECK_SECONDS
        return Reconciled(new, requeue_after=wait)

    def _as_the_ray_job_ended(self, ref: JobRef, rayjob: Obj) -> Obj:
        """KubeRay's late verdict (restarts.LATE_VERDICT) read against the Ray job's own
        status, asked of the head; Failed, as KubeRay said, when the head cannot say."""
        url, answer = head_job_url(rayjob), None
        try:
            answer = self.ask_head(url) if url else None
        except (OSError, ValueError) as error:  # unreachable, gone, or not JSON
            log.warning("%s/%s: could not ask the Ray head at %s how the job ended: %s",
                        ref.namespace, ref.name, url, error)  # fmt: skip
        ended = as_the_ray_job_ended(rayjob, answer)
        said = (answer or {}).get("status")
        log.info("%s/%s: KubeRay marked RayJob %s Failed (%s) over 30 s after its submitter "
                 "ended; the head says the Ray job is %s: %s", ref.namespace, ref.name,
                 ref.rayjob, LATE_VERDICT, said or "(no answer)",
                 "Failed" if ended is rayjob else ended["status"]["jobStatus"])  # fmt: skip
        return ended

    def _replace_workers_of_the_lost_head(
        self, ref: JobRef, observed: Observed, new: RLHFJobStatus
    ) -> None:
        """Delete the worker pods that joined the Ray head that was lost: KubeRay makes
        new ones, which wait for the new head, rather than leave theirs to crash-loop
        into minutes of backoff (`workers_of_a_lost_head`)."""
        workers = workers_of_a_lost_head(observed.pods, new.ray_cluster, new.ray_head)
        for pod in workers:
            meta = pod["metadata"]
            self.kube.delete("Pod", ref.namespace, meta["name"], uid=meta["uid"])
        if workers:
            log.info("%s/%s: the Ray head was lost; %d worker pod(s) of it deleted, for "
                     "KubeRay to make new ones for %s", ref.namespace, ref.name, len(workers),
                     new.ray_head)  # fmt: skip

    def _observe(
        self, ref: JobRef, spec: RLHFJobSpec, rayjob: Obj | None, workload: Obj | None,
        live: list[Obj] | None, old: RLHFJobStatus,
    ) -> Observed:  # fmt: skip
        """What the status is computed from. `live`: the children as _ensure_children
        left them (None where this reconcile ensured none: it looks for itself). A new
        Ray head is recorded on the RayJob before the status says so (heads.py)."""
        selector = f"{JOB_LABEL}={ref.name}"
        pods = self.kube.list("Pod", ref.namespace, selector)  # head, pools, submitter, envs
        head = observe_head(rayjob, pods, old, self.now())
        if head.record is not None and rayjob is not None:
            if "deletionTimestamp" not in rayjob["metadata"]:
                patched = self.kube.patch("RayJob", ref.namespace, ref.rayjob,
                                          record_patch(head.record))  # fmt: skip
                # Its metadata only: the status may be read against the head (a late verdict).
                rayjob = rayjob | {"metadata": patched["metadata"]}
            else:  # going: its next attempt records its own head
                head = replace(head, driver_restarts=old.driver_restarts, record=None)
        if live is not None:
            deployments = [c for c in live if c["kind"] == "Deployment"]
        elif any(e.operator_run for e in spec.environments) or any(
            a.operator_run for a in spec.agents
        ):
            # A failed attempt or a resize: the services' Deployments stay as they are.
            deployments = self.kube.list("Deployment", ref.namespace, selector)
        else:
            deployments = []
        return Observed(rayjob, pods, workload, deployments, head)

    def _ensure_children(
        self, ref: JobRef, spec: RLHFJobSpec, children: list[Obj], rayjob: Obj | None,
        new_job: bool, unbound: bool,
    ) -> tuple[Obj | None, list[Obj], list[Future[Obj | None]]]:  # fmt: skip
        """The RayJob as it now is, the other children (those that exist), and the
        RoleBindings still being made. `unbound`: this process made the job's other
        children and not yet its RoleBindings."""
        *dependencies, desired_rayjob = children
        # No RayJob means a new job (or one whose children were wiped): try creating
        # first, which saves a read per child on the path users wait on. The RayJob
        # goes with the first round: nothing mounts or names it, and what its pods need
        # (the ServiceAccount, the ConfigMap) is asked for beside it, rounds before
        # KubeRay makes a pod (it makes the RayCluster, which makes the pods; a pod
        # refused for a missing ServiceAccount is made again). A RoleBinding waits for
        # its Role: the operator has no `bind` verb, so the API server checks that it
        # holds the Role's rules, and answers 404 while the Role is not there. Only the
        # trainer needs it, once it runs: a new job's is made in its report's pass, and
        # any is made while the status is reported (its Event, then its patch).
        bindings = [obj for obj in dependencies if obj["kind"] == "RoleBinding"]
        others = [obj for obj in dependencies if obj["kind"] != "RoleBinding"]
        if rayjob is None:
            live = self._ensure_all(ref, [desired_rayjob, *others], likely_missing=True)
            binding = [] if new_job else self._ensure_later(ref, bindings, likely_missing=True)
            made = next((obj for obj in live if obj["kind"] == "RayJob"), None)
            return made, [obj for obj in live if obj is not made], binding
        live = self._ensure_all(ref, others)
        self._check_owner(ref, rayjob)
        binding = self._ensure_later(ref, bindings, likely_missing=unbound)
        return sync_rayjob(self.kube, ref, spec, rayjob, desired_rayjob), live, binding

    def _ensure_later(
        self, ref: JobRef, objects: list[Obj], likely_missing: bool
    ) -> list[Future[Obj | None]]:
        """_ensure each, in the background: the caller waits for them before it ends."""
        return [self.fanout.submit(self._ensure, ref, obj, likely_missing) for obj in objects]

    def _ensure_all(
        self, ref: JobRef, objects: list[Obj], likely_missing: bool = False
    ) -> list[Obj]:
        """_ensure each at once (they need nothing from each other); those that exist."""
        ensured = self.fanout.map(
            lambda desired: self._ensure(ref, desired, likely_missing), objects
        )
        return [obj for obj in ensured if obj is not None]

    def _ensure(self, ref: JobRef, desired: Obj, likely_missing: bool) -> Obj | None:
        """Create the child, or bring its OWNED_FIELDS to the rendered values; returns it
        as the API server has it (None: its namespace is going)."""
        kind, name = desired["kind"], desired["metadata"]["name"]
        if likely_missing and (created := self.kube.create(desired)) is not None:
            return created
        existing = self.kube.get(kind, ref.namespace, name)
        if existing is None:
            if self._gone(ref):
                raise JobGone(ref.name)
            return self.kube.create(desired)
        self._check_owner(ref, existing)
        owned = OWNED_FIELDS.get(kind, ())
        drift = {f: desired[f] for f in owned if drifted(existing.get(f), desired[f])}
        if drift:
            return self.kube.patch(kind, ref.namespace, name, drift)
        return existing

    def _gone(self, ref: JobRef) -> bool:
        """Whether the job was deleted, asked of the API server before a child is made:
        the garbage collector takes a deleted job's children before the watch may have
        told the cache that the job went, and a child made for it again would only be
        collected again (a RayJob: a whole Ray cluster started)."""
        live = self.kube.read("RLHFJob", ref.namespace, ref.name)
        meta = (live or {}).get("metadata", {})
        return meta.get("uid") != ref.uid or "deletionTimestamp" in meta

    def _check_owner(self, ref: JobRef, obj: Obj) -> None:
        owners = obj["metadata"].get("ownerReferences") or []
        if not any(o.get("uid") == ref.uid and o.get("controller") for o in owners):
            raise ChildConflict(
                f"{obj['kind']} {obj['metadata']['name']} exists but is not owned by "
                f"RLHFJob {ref.name}; delete or rename it"
            )

    def _ask_stop(self, ref: JobRef, rayjob: Obj, resizes: tuple[PoolResize, ...]) -> Obj:
        """Record the ask on the attempt before the status (which the trainer reads)
        makes it: an exit 0 from then on is a stop for a resize (resizes.stopped_early)."""
        if stop_asked(rayjob):
            return rayjob
        return self.kube.patch("RayJob", ref.namespace, ref.rayjob, stop_asked_patch(resizes))

    def _write_status(self, job: Obj, old: RLHFJobStatus, new: RLHFJobStatus) -> None:
        """Patch status only when it changed; leave the trainer's `training` alone. The
        events that say what changed are posted first: once the status shows a change,
        its event is there (an operator that dies in between posts it again, rather than
        never; Events aggregate)."""
        patch = status_patch(old, new)
        if patch is None:
            return
        invalid = invalid_message(new)
        if new.phase != old.phase or invalid != invalid_message(old):
            warning = bool(invalid) or new.phase in WARNING_PHASES
            warning |= new.phase is Phase.SUCCEEDED and not reported_to_the_end(new.training)
            reason = "InvalidSpec" if invalid else new.phase.value
            self.events.post(job, reason, invalid or phase_message(new), warning)
        if new.driver_restarts > old.driver_restarts:
            self.events.post(job, DRIVER_RESTARTED, driver_restart_message(old, new), warning=True)
        said = warnings(old)
        for (kind, reason), message in warnings(new).items():
            if said.get((kind, reason)) != message:
                self.events.post(job, reason, message, warning=True)
        meta = job["metadata"]
        self.kube.patch("RLHFJob", meta["namespace"], meta["name"], {"status": patch},
                        subresource="status")  # fmt: skip
