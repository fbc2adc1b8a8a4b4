"""The gateway: an OpenAI-compatible endpoint served by each rollout engine, in front of
its vLLM engine, for agents that own their loop (issue 75).

- `records`: the episodes open on one engine (bound to API keys), their limits, and the
  token-exact record of every call (prompt ids, sampled ids, log-probs, weight versions).
- `server`: vLLM's own chat serving over the engine's AsyncLLM, behind a small FastAPI app
  that checks the key and the limits and records each call.
- `exact`: a call that continues the conversation samples from the earlier call's ids,
  not from its text tokenised again.
- `merge`: an episode's calls as training samples (pure).
- `host`: the rollout worker's methods (start_gateway, open/close_agent_episode).

rollout/agent_episodes.py runs an episode end to end (gateway, agent, merge).
"""
