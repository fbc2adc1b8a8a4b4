"""Generation: the vLLM engine of both modes (`engine`) and the weights as it loads them
(`engine_weights`), the rollout role's workers (`worker` for synchronous PPO, `streaming`
for fully async), the queue and admission between rollout and trainer (`queue`), and
the weights from the actor through vLLM's weight-transfer API (`transfer_engines`, with
the CPU backend's buckets in `weight_sync` and its memory in `transfer_memory`)."""
