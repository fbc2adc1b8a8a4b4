"""rlhf-trainer: the PPO loop with split placement and fully asynchronous training."""
