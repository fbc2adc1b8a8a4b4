"""The algorithm: PPO maths as small pure tensor functions (`ppo`), and the experience
batch the loop, the roles and the checkpoints pass around (`experience`)."""
