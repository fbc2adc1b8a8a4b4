"""Environments for agentic RL: a small HTTP protocol, a server for a plain Python class,
and the trainer's client. It imports nothing of the trainer or the ML stack (`make lint`
holds it to that), so an environment's image needs only pydantic, FastAPI and uvicorn.

    protocol     the contract: messages, tool schemas, each call's body
    environment  what a user writes (reset, step, score), and how it is loaded
    server       the FastAPI app that serves a class: `python -m rlhf_env serve module:Class`
    sessions     its sessions: per-call deadlines, liveness, idle expiry, the session limit
    client       the trainer's async client
    replicas     an environment's replicas: sessions spread, a refused start made elsewhere
    toys         small environments: Lookup, Calculator, and LetterLookup for tiny models
"""
