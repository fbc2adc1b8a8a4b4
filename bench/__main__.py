"""`python -m bench [NAME...]` (`make bench`): run every bench (or those named), one after
another, showing their output, then a summary of each one's headline figures.

Each bench is a process of its own (`python -m bench.<module>.run`) whose last line is
its JSON record (bench/harness.py). The records are also written to bench/results.jsonl.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHES = {  # name -> module
    "split": "bench.split_placement.run",
    "async": "bench.async.run",
    "slow_reward": "bench.async.slow_reward",
    "elastic": "bench.async.elastic",
    "algorithms": "bench.algorithms.run",
    "learning": "bench.learning.run",
    "agentic": "bench.agentic.run",
    "agent_gateway": "bench.agent_gateway.run",
    "weight_sync": "bench.weight_sync.run",
    "operator": "bench.operator.run",
    "real_model": "bench.real_model.run",
    "gpu_train_step": "bench.gpu_train_step.run",
    "gpu_ipc": "bench.gpu_ipc.run",
    "contention": "bench.contention.run",
    "overhead": "bench.overhead.run",
}
HEADLINES = {  # name -> the figures its summary shows
    "split": [
        "efficiency",
        "measured_speedup",
        "ideal_speedup",
        "split.driver_share",
        "estimate_error",
    ],
    "async": [
        "ratio",
        "async.idle.rollout",
        "async.idle.train",
        "async.driver_share",
        "pipeline_efficiency",
        "estimate_error",
    ],
    "slow_reward": [
        "speedup",
        "spread_speedup",
        "ahead.samples_per_s",
        "at_the_step.samples_per_s",
    ],
    "elastic": [
        "grow_after_over_before",
        "grow_after_over_fixed_2",
        "fixed_2_over_fixed_1",
        "grow.node_to_serving_s",
        "grow.join_stall_s",
    ],
    "algorithms": ["grpo_speedup", "ppo.samples_per_s", "grpo.samples_per_s"],
    "learning": [
        "sync-colocated.final_held_out",
        "async-s0.5.held_out_vs_sync",
        "async-s0.5.samples_per_s",
        "sync-colocated.samples_per_s",
    ],
    "agentic": [
        "example.held_out_start",
        "example.held_out_final",
        "example.tool_calls_first",
        "example.tool_calls_last",
    ],
    "agent_gateway": [
        "agent.held_out_final",
        "trainer.held_out_final",
        "episodes_per_s_ratio",
        "tokens_per_s_ratio",
    ],
    "weight_sync": [
        "transfer_one_of_memcpy",
        "end_to_end_one_of_memcpy",
        "end_to_end_two_of_memcpy",
        "memcpy.gb_per_s",
    ],
    "real_model": ["fp32.generation_tokens_per_s", "fp32.actor_training_tokens_per_s"],
    "gpu_train_step": ["actor_bf16.mfu", "actor_bf16.tokens_per_s", "autocast.tokens_per_s"],
    "gpu_ipc": ["ipc_share", "ipc.gb_per_s", "ipc_fresh.open_s"],
    "contention": ["slowdown"],
    "overhead": ["rollout", "training", "train_job.push_s", "train_job.in_rank_share"],
}
RESULTS = Path(__file__).with_name("results.jsonl")


def run(module: str) -> dict[str, Any]:
    """Run one bench, echoing its output; its last line is its record."""
    lines = []
    with subprocess.Popen(
        [sys.executable, "-m", module], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    if proc.returncode != 0 or not lines:
        return {"failed": f"exit status {proc.returncode}"}
    record: dict[str, Any] = json.loads(lines[-1])
    return record


def summary(name: str, record: dict[str, Any]) -> list[str]:
    if "failed" in record:
        return [f"{name}: FAILED ({record['failed']})"]
    if name == "operator":
        return [
            f"operator n={r['n']}: ours/KubeRay p50 {r['ratio_p50']}, p99 {r['ratio_p99']}"
            for r in record["sizes"]
        ]
    figures = record["figures"]
    return [
        f"{name} {key}: {f['median']} ({f['min']}-{f['max']})"
        for key in HEADLINES[name]
        if (f := figures.get(key))
    ]


def main(names: list[str]) -> int:
    unknown = set(names) - set(BENCHES)
    if unknown:
        print(f"unknown bench {sorted(unknown)}; the benches: {list(BENCHES)}", file=sys.stderr)
        return 2
    records = {name: run(BENCHES[name]) for name in names or BENCHES}
    with RESULTS.open("a") as out:
        for record in records.values():
            out.write(json.dumps(record) + "\n")
    print("\nSummary: median (min-max) over interleaved repeats")
    for name, record in records.items():
        print("\n".join(summary(name, record)))
    return 1 if any("failed" in r for r in records.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
