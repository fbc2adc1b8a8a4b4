"""`python -m rlhf_env serve module:Class`: serve an environment class over HTTP.

The class is imported as `module:Class` (the current directory is on the import path),
and each session is an instance of it. In a pod, pass `--host 0.0.0.0`.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from rlhf_env.environment import NotAnEnvironment, load_environment_class
from rlhf_env.server import app_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_env", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve an environment class over HTTP")
    serve.add_argument("target", metavar="module:Class", help="the class, e.g. my_envs:Lookup")
    # Loopback unless asked: an environment runs the model's tool calls.
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--max-sessions", type=int, help="refuse new sessions (503) past this many at once"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args(argv)
    try:
        environment_cls = load_environment_class(args.target)
    except NotAnEnvironment as error:
        print(f"python -m rlhf_env serve: {error}", file=sys.stderr)
        return 2
    return serve_forever(environment_cls, args)


def serve_forever(environment_cls: type, args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = app_for(environment_cls, max_sessions=args.max_sessions)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
