"""The training loops: one synchronous PPO step for every placement (`sync`), the
fully-async trainer fed by the rollout pool (`fully_async`), and a run with
checkpoints and resume (`run`)."""
