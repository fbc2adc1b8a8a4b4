"""The role workers that run models: the actor and ref policy (`policy`), the critic
(`critic`), a reward model (`reward`), what the trainable ones share (`trainable`),
FSDP2 sharding (`sharding`) and atomic, reshardable checkpoints (`checkpoint`)."""
