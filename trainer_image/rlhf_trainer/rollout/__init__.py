"""Generation: the vLLM engine of both modes (`engine`) and the weights as it loads them
(`engine_weights`), the rollout role's workers (`worker` for synchronous PPO, `streaming`
for fully async), the queue and admission between rollout and trainer (`queue`), and
the weight broadcast from the actor (`weight_sync`)."""
