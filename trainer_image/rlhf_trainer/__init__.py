"""The trainer: PPO-style RLHF on Ray, with the job's roles placed on GPU pools.

The packages, from the contract up (each imports only those below it; `make lint`
holds them to it):

    api        the operator<->trainer contract: spec models, rules, placement plan, names
    algo       the algorithm: PPO maths, advantage estimators, the experience batch
    models     tiny models and their tokenizer, the value model
    data       prompts from datasets, toy tasks and rule-based rewards
    telemetry  metrics, the timeline of the pools, status reporting
    worker     one rank of a role (plain Python) and its process group
    rollout    the vLLM engine, the rollout workers, the sample queue, weight sync
    roles      actor, ref, critic and reward workers; FSDP2 sharding; checkpoints
    cluster    Ray: placement groups, worker groups, the local cluster (the only Ray)
    loop       the synchronous step, the fully-async trainer, a run with resume
"""
