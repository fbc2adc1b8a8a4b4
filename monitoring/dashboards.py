"""The three dashboards: RLHF pools, RLHF training and RLHF operator.

Series come from the trainer (`rlhf_*`, served by the job's driver), the rollout
engines (`rlhf_vllm_*`, through the driver), the operator (`rlhf_operator_*`,
`rlhf_pool_gpus`, `rlhf_job_restarts`) and, for GPU utilisation, NVIDIA's DCGM exporter
joined to the job's pods through kube-state-metrics' `kube_pod_labels`.
"""

from __future__ import annotations

from monitoring.agentic import AGENTS, MULTI_TURN
from monitoring.charts import (
    JOB,
    POOL,
    Dashboard,
    Row,
    Style,
    chart,
    quantile,
    rate,
    series,
    step_gauges,
)

DCGM = "DCGM exporter and kube-state-metrics"

# kube-state-metrics exports pod labels it is allowed to (its
# --metric-labels-allowlist=pods=[rlhf.dev/job,rlhf.dev/pool]) as label_rlhf_dev_*.
_JOB_PODS = (
    'kube_pod_labels{namespace=~"$namespace", label_rlhf_dev_job=~"$job", '
    'label_rlhf_dev_pool=~"$pool"}'
)


def gpus_by_pool(dcgm_series: str, aggregate: str) -> str:
    """A DCGM series per GPU, joined to the pool of the pod that holds the GPU."""
    pods = f'label_replace({_JOB_PODS}, "pool", "$1", "label_rlhf_dev_pool", "(.+)")'
    return f"{aggregate} by (pool) ({dcgm_series} * on (namespace, pod) group_left (pool) {pods})"


POOLS = Dashboard(
    uid="rlhf-pools",
    title="RLHF pools",
    description="How busy each GPU pool of an RLHFJob is, where a step's time goes, "
    "and the rollout engines' load.",
    variables_from="rlhf_pool_busy_ratio",
    rows=(
        Row(
            "Pools",
            (
                chart(
                    "Busy share by pool",
                    "Share of wall time since the trainer started that any role of the pool "
                    "was running. Split and fully-async placements aim for every pool near 1.",
                    (series("rlhf_pool_busy_ratio", POOL), "{{rlhfjob}} {{pool}}"),
                    unit="percentunit",
                ),
                chart(
                    "Idle share by pool",
                    "The complement of the busy share: time the pool's GPUs waited.",
                    (series("rlhf_pool_idle_ratio", POOL), "{{rlhfjob}} {{pool}}"),
                    unit="percentunit",
                ),
                chart(
                    "Busy by role",
                    "Seconds each role ran per second of wall time, by pool. Colocated "
                    "roles take turns on the same GPUs, so their sum stays at or below 1.",
                    (
                        rate("rlhf_role_busy_seconds_total", POOL, by="rlhfjob, pool, role"),
                        "{{pool}} {{role}}",
                    ),
                    unit="percentunit",
                    style=Style.STACKED,
                ),
            ),
        ),
        Row(
            "GPUs",
            (
                chart(
                    "GPU utilisation by pool",
                    "DCGM's GPU utilisation, averaged over each pool's GPUs.",
                    (gpus_by_pool("DCGM_FI_DEV_GPU_UTIL", "avg"), "{{pool}}"),
                    unit="percent",
                    exporter=DCGM,
                ),
                chart(
                    "GPU memory used by pool",
                    "DCGM's frame-buffer memory in use, summed over each pool's GPUs.",
                    (gpus_by_pool("DCGM_FI_DEV_FB_USED", "sum"), "{{pool}}"),
                    unit="decmbytes",
                    exporter=DCGM,
                ),
            ),
        ),
        Row(
            "Steps",
            (
                chart(
                    "Step time by phase",
                    "Seconds per second spent in each phase of a PPO step (generate, "
                    "score, update...). Phases of different pools overlap in split mode.",
                    (rate("rlhf_step_phase_seconds_sum", by="phase"), "{{phase}}"),
                    unit="percentunit",
                    style=Style.STACKED,
                ),
                chart(
                    "Phase duration, p95",
                    "The 95th percentile of each phase's duration.",
                    (quantile(0.95, "rlhf_step_phase_seconds", by="phase"), "{{phase}}"),
                    unit="s",
                ),
                chart(
                    "Throughput",
                    "Samples trained and response tokens generated per second.",
                    (rate("rlhf_samples_trained_total"), "{{rlhfjob}} samples/s"),
                    (rate("rlhf_tokens_generated_total"), "{{rlhfjob}} tokens/s"),
                    unit="ops",
                ),
            ),
        ),
        Row(
            "Rollout engines (vLLM)",
            (
                chart(
                    "Requests running and waiting",
                    "Requests each vLLM engine is generating, and those queued in it.",
                    (series("rlhf_vllm_requests_running", POOL), "{{pool}}/{{engine}} running"),
                    (series("rlhf_vllm_requests_waiting", POOL), "{{pool}}/{{engine}} waiting"),
                ),
                chart(
                    "KV-cache usage",
                    "Share of each engine's KV-cache blocks in use.",
                    (series("rlhf_vllm_kv_cache_usage_ratio", POOL), "{{pool}}/{{engine}}"),
                    unit="percentunit",
                ),
                chart(
                    "Engine tokens/s",
                    "Tokens each engine generated and prefilled per second.",
                    (
                        rate("rlhf_vllm_generation_tokens_total", POOL, by="pool, engine"),
                        "{{pool}}/{{engine}} generated",
                    ),
                    (
                        rate("rlhf_vllm_prompt_tokens_total", POOL, by="pool, engine"),
                        "{{pool}}/{{engine}} prompt",
                    ),
                    unit="ops",
                ),
                chart(
                    "Engines serving and lost",
                    "Rollout engines serving, and those lost (a vLLM engine that died, a pod "
                    "or node gone), each replaced in its bundle; their work is done again.",
                    (series("rlhf_rollout_engines", POOL), "{{pool}} {{state}}"),
                ),
            ),
        ),
    ),
)


TRAINING = Dashboard(
    uid="rlhf-training",
    title="RLHF training",
    description="What an RL practitioner looks at first when a run goes wrong: reward, "
    "KL, the actor's and critic's updates, the responses, and fully-async staleness.",
    variables_from="rlhf_policy_version",
    rows=(
        Row(
            "Reward and KL",
            (
                chart(
                    "Reward",
                    "Mean reward of the last step's samples.",
                    *step_gauges(("rlhf_reward_mean", "reward")),
                ),
                chart(
                    "Held-out evaluation",
                    "The held-out prompts (data.eval), answered before training, every "
                    "evalEverySteps steps and at the end: mean reward, and the share of "
                    "answers (pass@1) and of prompts (pass@k, k answers each) that pass.",
                    *step_gauges(
                        ("rlhf_eval_reward_mean", "held-out reward"),
                        ("rlhf_eval_pass_at_1", "pass@1"),
                        ("rlhf_eval_pass_at_k", "pass@k"),
                    ),
                ),
                chart(
                    "KL",
                    "KL to the reference policy (what the KL penalty holds), and the "
                    "update's own approximate KL from the policy that generated the batch.",
                    *step_gauges(("rlhf_kl", "to reference"), ("rlhf_actor_approx_kl", "update")),
                ),
                chart(
                    "KL coefficient",
                    "The KL penalty's coefficient: klCoef throughout with a fixed "
                    "klController; with an adaptive one, it rises while the KL is above "
                    "targetKL and falls while below.",
                    *step_gauges(("rlhf_kl_coef", "coefficient")),
                ),
                chart(
                    "Policy version",
                    "The version of the policy being trained: one per actor update.",
                    *step_gauges(("rlhf_policy_version", "version")),
                ),
                chart(
                    "Unscored samples",
                    "Samples per second the reward service failed to score after its "
                    "retries: not trained on (models.reward.requests.maxUnscoredSteps).",
                    (rate("rlhf_reward_unscored_samples_total"), "{{rlhfjob}}"),
                    unit="ops",
                ),
            ),
        ),
        Row(
            "Actor and critic",
            (
                chart(
                    "Policy loss",
                    "The clipped surrogate loss, mean over response tokens.",
                    *step_gauges(("rlhf_actor_policy_loss", "policy loss")),
                ),
                chart(
                    "Clip fraction",
                    "Share of tokens where the clipped ratio set the loss. High: steps are "
                    "too big for the clip range.",
                    *step_gauges(
                        ("rlhf_actor_clip_fraction", "policy"),
                        ("rlhf_actor_importance_capped", "importance weights capped"),
                    ),
                    unit="percentunit",
                ),
                chart(
                    "Entropy",
                    "Entropy of the policy over response tokens: a collapse to 0 means the "
                    "policy stopped exploring.",
                    *step_gauges(("rlhf_actor_entropy", "entropy")),
                ),
                chart(
                    "Gradient norms",
                    "Before clipping, mean over the step's optimizer steps.",
                    *step_gauges(
                        ("rlhf_actor_grad_norm", "actor"), ("rlhf_critic_grad_norm", "critic")
                    ),
                ),
                chart(
                    "Value loss",
                    "The critic's clipped value loss (PPO with a critic only).",
                    *step_gauges(("rlhf_critic_value_loss", "value loss")),
                ),
                chart(
                    "Explained variance",
                    "How much of the returns' variance the critic's values explain: near 1 "
                    "is a good critic, at or below 0 a useless one.",
                    *step_gauges(("rlhf_critic_explained_variance", "explained variance")),
                ),
            ),
        ),
        Row(
            "Responses",
            (
                chart(
                    "Response length",
                    "Mean and longest response of the last step, in tokens.",
                    *step_gauges(
                        ("rlhf_response_length_mean", "mean"), ("rlhf_response_length_max", "max")
                    ),
                ),
                chart(
                    "Truncated share",
                    "Share of responses cut at maxResponseLength rather than ended by the "
                    "model. Rising: the policy is learning to ramble.",
                    *step_gauges(("rlhf_response_truncated_ratio", "truncated")),
                    unit="percentunit",
                ),
                chart(
                    "Groups dropped",
                    "Groups dynamic sampling dropped (all rewards equal) per second.",
                    (rate("rlhf_dropped_groups_total"), "{{rlhfjob}}"),
                    unit="ops",
                ),
            ),
        ),
        MULTI_TURN,
        AGENTS,
        Row(
            "Fully asynchronous",
            (
                chart(
                    "Sample staleness",
                    "Samples trained over the dashboard's range, by how many policy versions "
                    "behind the trained one they were generated (bounded by the job's "
                    "stalenessThreshold).",
                    (
                        f"sum by (le) (increase(rlhf_sample_staleness_bucket{{{JOB}}}[$__range]))",
                        "{{le}}",
                    ),
                    style=Style.BARS,
                ),
                chart(
                    "Queue depth",
                    "Finished samples waiting for the trainer. Near 0: the trainer waits "
                    "for the rollout; at its cap: the rollout waits for the trainer.",
                    *step_gauges(("rlhf_queue_depth", "queued")),
                ),
                chart(
                    "Weight sync",
                    "Seconds to send new weights to the rollout engines: median and p95.",
                    (quantile(0.5, "rlhf_weight_sync_seconds"), "{{rlhfjob}} p50"),
                    (quantile(0.95, "rlhf_weight_sync_seconds"), "{{rlhfjob}} p95"),
                    unit="s",
                ),
            ),
        ),
    ),
)

OPERATOR = Dashboard(
    uid="rlhf-operator",
    title="RLHF operator",
    description="The operator: jobs by phase, how fast it reconciles, the GPUs each pool "
    "asked for against those ready, and restarts.",
    variables_from="rlhf_pool_gpus",
    rows=(
        Row(
            "Jobs",
            (
                chart(
                    "Jobs by phase",
                    "RLHFJobs in each phase, across the namespaces the operator watches.",
                    ("sum by (phase) (rlhf_operator_jobs)", "{{phase}}"),
                    style=Style.STACKED,
                ),
                chart(
                    "GPUs per pool: desired and ready",
                    "GPUs each pool asked for against those in Ready pods: a gap that stays "
                    "is a pool the cluster cannot place.",
                    (series("rlhf_pool_gpus", POOL), "{{rlhfjob}}/{{pool}} {{state}}"),
                ),
                chart(
                    "Restarts",
                    "Attempts restarted after a failure (spec.restartPolicy).",
                    (series("rlhf_job_restarts"), "{{rlhfjob}}"),
                ),
            ),
        ),
        Row(
            "Reconciles",
            (
                chart(
                    "Reconcile latency",
                    "Duration of one reconcile of one job: p50, p90 and p99.",
                    *(
                        (quantile(q, "rlhf_operator_reconcile_duration_seconds", "", ""), f"p{p}")
                        for q, p in ((0.5, 50), (0.9, 90), (0.99, 99))
                    ),
                    unit="s",
                ),
                chart(
                    "Reconciles and errors",
                    "Reconciles per second, and those that failed (retried with backoff).",
                    (
                        "sum(rate(rlhf_operator_reconcile_duration_seconds_count"
                        "[$__rate_interval]))",
                        "reconciles",
                    ),
                    ("sum(rate(rlhf_operator_reconcile_errors_total[$__rate_interval]))", "errors"),
                    unit="ops",
                ),
                chart(
                    "Work queue",
                    "Jobs waiting to be reconciled.",
                    ("sum(rlhf_operator_queue_depth)", "queued"),
                ),
                chart(
                    "API server requests",
                    "What the operator asks of the Kubernetes API server, by verb and kind. "
                    "It reads jobs, pods and children from its watches: reads here are "
                    "misses (a child just made), the RayCluster of a pool resized in place, "
                    "and Kueue's Workloads.",
                    (
                        "sum by (verb, kind) "
                        "(rate(rlhf_operator_api_requests_total[$__rate_interval]))",
                        "{{verb}} {{kind}}",
                    ),
                    unit="reqps",
                ),
            ),
        ),
    ),
)

DASHBOARDS = (POOLS, TRAINING, OPERATOR)
