"""Generation: the vLLM engine (`engine`, `async_engine`), the rollout role's workers
(`worker` for synchronous PPO, `streaming` for fully async), the queue and admission
between rollout and trainer (`queue`), and the weight broadcast (`weight_sync`)."""
