"""OpenAI-compatible server: `blockspec serve` (FastAPI + uvicorn, Prometheus metrics).

Only the command-line wiring lives here, so `blockspec --help` does not import the web stack.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_serve_parser(sub: Any) -> None:
    from blockspec.cli import add_model_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)",
                       description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics.")
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    g.add_argument("--seed", type=int, default=None, help="engine seed for requests that give none")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; exit 2 if the model cannot be loaded."""
    import uvicorn

    from blockspec.cli import build_llm
    from blockspec.server.app import create_app

    def load_failed(message: str) -> None:
        print(f"error: {message}", file=sys.stderr)
        server.should_exit = True

    app = create_app(lambda: build_llm(args), args.served_model_name or args.model, on_load_error=load_failed)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    server.run()
    return 2 if app.state.engine.load_error else 0
