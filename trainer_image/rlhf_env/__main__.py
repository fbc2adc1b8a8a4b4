"""`python -m rlhf_env serve module:Class`: serve an environment class over HTTP;
`python -m rlhf_env serve-reward module:function`: serve a reward function (rewards.py);
`python -m rlhf_env agent module:function`: serve an agent function (agent.py; it needs
the `openai` package, which only this command imports).

The class is imported as `module:Class` (the current directory is on the import path),
and each session is an instance of it. In a pod, pass `--host 0.0.0.0`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import cast

import uvicorn
from fastapi import FastAPI

from rlhf_env.environment import NotAnEnvironment, load_environment_class, load_function
from rlhf_env.rewards import reward_app_for
from rlhf_env.server import app_for
from rlhf_env.sessions import DEFAULT_CALL_SECONDS, DEFAULT_IDLE_SECONDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_env", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve an environment class over HTTP")
    serve.add_argument("target", metavar="module:Class", help="the class, e.g. my_envs:Lookup")
    serve.add_argument(
        "--max-sessions", type=int, help="refuse new sessions (503) past this many at once"
    )
    serve.add_argument(
        "--call-seconds",
        type=float,
        default=DEFAULT_CALL_SECONDS,
        help="end a call into the class (504) and its session past this (default: %(default)g)",
    )
    serve.add_argument(
        "--idle-seconds",
        type=float,
        default=DEFAULT_IDLE_SECONDS,
        help="end a session no call has used for this long (default: %(default)g)",
    )
    reward = commands.add_parser(
        "serve-reward", help="serve a reward function over HTTP (models.reward.url)"
    )
    reward.add_argument(
        "target", metavar="module:function", help="f(prompt, response, **row) -> float"
    )
    agent = commands.add_parser(
        "agent", help="serve an agent function over the agent protocol (agents[].serve)"
    )
    agent.add_argument(
        "target", metavar="module:function", help="async def run(task, client) -> float | None"
    )
    agent.add_argument(
        "--max-episodes", type=int, help="refuse new episodes (503) past this many at once"
    )
    for command in (serve, reward, agent):
        # Loopback unless asked: an environment runs the model's tool calls.
        command.add_argument("--host", default="127.0.0.1", help="address to listen on")
        command.add_argument("--port", type=int, default=8000, help="port to listen on")
        command.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args(argv)
    try:
        if args.command == "serve-reward":
            app = reward_app_for(load_function(args.target))
        elif args.command == "agent":
            app = agent_app(args.target, args.max_episodes)
        else:
            app = app_for(
                load_environment_class(args.target),
                max_sessions=args.max_sessions,
                call_seconds=args.call_seconds,
                idle_seconds=args.idle_seconds,
            )
    except (NotAnEnvironment, ModuleNotFoundError) as error:
        print(f"python -m rlhf_env {args.command}: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def agent_app(target: str, max_episodes: int | None) -> FastAPI:
    """The agent function `target`, served (imported here: only agents need openai)."""
    try:
        from rlhf_env.agent import AgentRun, app_for_agent
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"serving an agent needs the openai package: {error}") from error
    run = cast("AgentRun", load_function(target))  # app_for_agent checks it is async
    return app_for_agent(run, max_episodes=max_episodes)


if __name__ == "__main__":
    sys.exit(main())
