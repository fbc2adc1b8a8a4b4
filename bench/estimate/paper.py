"""The estimator against a published figure: verl's Qwen2.5-Math-7B DAPO runs on H20s.

Rates from the colocated 64-GPU run (rlhf_trainer/api/profiles/h20-qwen2.5-math-7b.yaml);
predicted: the fully async run on 64:64 GPUs and the colocated run on 128. The async run
is estimated twice: recomputing the old log-probs on the trainer pool (our default,
oldLogProbs: recompute) and taking the rollout's (oldLogProbs: rollout), as verl runs it
(its table has no old_log_prob for it). Run: python -m bench.estimate.paper (instant;
nothing is trained).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_operator.api.validation import load_documents, parse_job
from rlhf_trainer.api.estimate import estimate, load_profile

JOBS = Path(__file__).with_name("verl-7b.yaml")
PUBLISHED_STEP_S = {  # verl's table: mean seconds a step (512 prompts x 16 responses)
    "verl-colocate-64": 365.28,
    "verl-colocate-128": 356.30,
    "verl-async-64-64": 150.63,
    "verl-async-64-64-rollout-log-probs": 150.63,  # the same run: verl takes the rollout's
}


def main() -> None:
    profile = load_profile("h20-qwen2.5-math-7b")
    jobs = {
        job.metadata.name: job.spec.job_config()
        for job in map(parse_job, load_documents(JOBS.read_text()))
    }
    rows = {name: estimate(config, profile).step_seconds for name, config in jobs.items()}
    table: list[dict[str, object]] = []
    print(f"{'job':<36} {'published s':>11} {'estimated s':>11} {'error':>7}")
    for name, estimated in rows.items():
        published = PUBLISHED_STEP_S[name]
        error = estimated / published - 1
        print(f"{name:<36} {published:>11.2f} {estimated:>11.2f} {error:>+7.1%}")
        table.append({"job": name, "published_s": published, "estimated_s": round(estimated, 2)})
    print(json.dumps({"bench": "estimate_paper", "rows": table}))


if __name__ == "__main__":
    main()
