"""The algorithm: PPO maths as small pure tensor functions (`ppo`), the advantage
estimators, GAE and the critic-free ones (`estimators`), the experience batch the loop,
the roles and the checkpoints pass around (`experience`), and the numbers each step
reports (`diagnostics`)."""
