"""`python -m rlhf_env serve module:Class`: serve an environment class over HTTP;
`python -m rlhf_env serve-reward module:function`: serve a reward function (rewards.py).

The class is imported as `module:Class` (the current directory is on the import path),
and each session is an instance of it. In a pod, pass `--host 0.0.0.0`.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

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
    for command in (serve, reward):
        # Loopback unless asked: an environment runs the model's tool calls.
        command.add_argument("--host", default="127.0.0.1", help="address to listen on")
        command.add_argument("--port", type=int, default=8000, help="port to listen on")
        command.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args(argv)
    try:
        if args.command == "serve-reward":
            app = reward_app_for(load_function(args.target))
        else:
            app = app_for(
                load_environment_class(args.target),
                max_sessions=args.max_sessions,
                call_seconds=args.call_seconds,
                idle_seconds=args.idle_seconds,
            )
    except NotAnEnvironment as error:
        print(f"python -m rlhf_env {args.command}: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
