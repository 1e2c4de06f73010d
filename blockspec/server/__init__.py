"""OpenAI-compatible server: `blockspec serve` (FastAPI + uvicorn, Prometheus metrics).

Only the command-line wiring lives here, so `blockspec --help` does not import the web stack.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import sys
from typing import Any

from blockspec.config import ConfigError, ServerConfig

log = logging.getLogger("blockspec")
SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")  # the [server] extra's


def add_serve_parser(sub: Any) -> None:
    from blockspec.cli_options import HelpFormatter, add_model_args, json_object, json_strings, port_number

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)",
                       description="Serve a model over the OpenAI API: /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics, and vLLM's /tokenize, /detokenize, /version.",
                       formatter_class=HelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=port_number, default=8000, help="TCP port to listen on, 0-65535 (0: any free one)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model names clients may send; a response carries its request's, else the first "
                        "(default: MODEL)")
    g.add_argument("--seed", type=int, default=None, help="engine seed for requests that give none (default: 0)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server log's level")
    g.add_argument("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug",
                                                                 "trace"],
                   help="uvicorn's own log level (vLLM's flag; default: --log-level)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's sake: blockspec logs no request's contents")
    g.add_argument("--enable-log-requests", "--enable-log-outputs", dest="enable_log_requests", action="store_true",
                   help="vLLM's request (and output) logging: accepted with a warning, blockspec logs no request's "
                        "contents")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="accepted for vLLM's sake: usage always has prompt_tokens_details (cached_tokens)")
    g.add_argument("--metrics-prefix", default=ServerConfig.metrics_prefix, choices=["vllm", "blockspec"],
                   help="/metrics names the metrics vLLM has vllm:... (its dashboards read them unchanged) or "
                        "blockspec:...; blockspec's own metrics are blockspec:... either way")
    g.add_argument("--disable-log-stats", action="store_true",
                   help=f"no throughput lines in the log (otherwise one every {ServerConfig.log_stats_interval_s:g} s "
                        "while busy)")
    env_key = os.environ.get("BLOCKSPEC_API_KEY") or os.environ.get("VLLM_API_KEY")
    g.add_argument("--api-key", nargs="+", default=[env_key] if env_key else None,
                   help="require 'Authorization: Bearer KEY' on /v1/ routes, any one of the keys given (default: "
                        "$BLOCKSPEC_API_KEY, else vLLM's $VLLM_API_KEY; none: open)")
    g.add_argument("--allowed-origins", type=json_strings, default=list(ServerConfig.allowed_origins),
                   help="CORS: the origins browsers may call from, as a JSON list (vLLM's flag)")
    g.add_argument("--allowed-methods", type=json_strings, default=list(ServerConfig.allowed_methods),
                   help="CORS: the methods browsers may use, as a JSON list")
    g.add_argument("--allowed-headers", type=json_strings, default=list(ServerConfig.allowed_headers),
                   help="CORS: the request headers browsers may send, as a JSON list")
    g.add_argument("--allow-credentials", "--allowed-credentials", dest="allowed_credentials", action="store_true",
                   help="CORS: browsers may send credentials (vLLM's flag)")
    g.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes,
                   help="refuse request bodies larger than this with a 413 (default: %(default)s)")
    g.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=None,
                   help="how tool calls are found in the model's text for tool_choice \"auto\" (hermes: Qwen2.5 / "
                        "Qwen3, llama3_json: Llama 3.1+); without it \"auto\" is refused (default: %(default)s)")
    g.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                   help="chat template variables for every chat request, as a JSON object (a request's "
                        "chat_template_kwargs win), e.g. '{\"enable_thinking\": false}' (default: none)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="tool_choice \"none\" leaves the request's tools out of the chat template (default: the "
                        "model is shown the tools it may not call, as vLLM does)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice \"auto\" is on whenever --tool-call-parser "
                        "is given (and, as vLLM, refused without one)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat template (rendering one runs the request's template "
                        "code on the server; default: refused)")
    g.add_argument("--response-role", default=ServerConfig.response_role,
                   help="the role of a chat response's message when the request adds a generation prompt (a "
                        "request that continues its last message gets that message's role)")
    g.add_argument("--root-path", default="",
                   help="the path prefix a reverse proxy serves this server under (ASGI root_path, vLLM's flag)")
    g.add_argument("--shutdown-timeout", type=float, default=0.0,
                   help="seconds SIGTERM or Ctrl-C waits for the requests in flight to finish before it aborts them "
                        "(vLLM's flag; default: %(default)s, abort at once); new connections are refused meanwhile")
    g.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle HTTP keep-alive connection stays open (default: %(default)s)")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM) and --ssl-certfile")
    g.add_argument("--ssl-certfile", default=None, help="the certificate (PEM) for --ssl-keyfile")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates (PEM) that client certificates are checked "
                                                         "against (with --ssl-cert-reqs)")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="whether a client certificate is required: 0 none, 1 optional, 2 required (Python's "
                        "ssl.CERT_* values, as vLLM and uvicorn take them)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, so the HTTP side never takes its interpreter "
                        "lock (default); --no-engine-process runs it on a thread of the server's process")
    p.set_defaults(func=run_serve)


def loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's loopback."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), IPv6 where the host is an IPv6 address; raises OSError (address in
    use, no such address) before the model loads, where uvicorn would find it only after."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; exit 2 if the model cannot be loaded or the engine process dies."""
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:  # one line, not an ImportError's traceback at start-up
        raise ConfigError(f"serve needs the server extras ({', '.join(missing)} not installed): "
                          'pip install "blockspec[server]"')
    if args.tensor_parallel_size != 1 and not args.engine_process:  # the ranks take their steps from pipes
        print(f"error: --tensor-parallel-size {args.tensor_parallel_size} needs the engine process: drop "
              "--no-engine-process", file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:  # vLLM refuses this at start too
        print("error: --enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)", file=sys.stderr)
        return 2
    if args.tensor_parallel_size > 1:  # a target the ranks cannot split is named before the server starts
        from blockspec.assets import embedded
        from blockspec.parallel.tp import target_for_ranks

        target_for_ranks(embedded(args.model), args.tensor_parallel_size, args.device, revision=args.revision,
                         download_dir=args.download_dir, token=args.hf_token)
    problem = ssl_problem(args) or (f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout:g}"
                                    if not args.shutdown_timeout >= 0 else None)
    if problem is not None:  # found before the model loads, not by uvicorn after
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        config = ServerConfig(api_key=tuple(args.api_key) if args.api_key else None,
                              max_request_bytes=args.max_request_bytes,
                              trust_request_chat_template=args.trust_request_chat_template,
                              tool_call_parser=args.tool_call_parser,
                              default_chat_template_kwargs=args.default_chat_template_kwargs,
                              metrics_prefix=args.metrics_prefix,
                              exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                              log_stats_interval_s=(None if args.disable_log_stats
                                                    else ServerConfig.log_stats_interval_s),
                              allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
                              allowed_headers=tuple(args.allowed_headers), allowed_credentials=args.allowed_credentials,
                              response_role=args.response_role)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as exc:
        print(f"error: cannot listen on {args.host} port {args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]  # the one the system chose for --port 0
    if args.enable_log_requests:
        print("warning: --enable-log-requests / --enable-log-outputs: blockspec logs no request's prompt or output; "
              "ignored", file=sys.stderr)
    if config.api_key is None and not loopback(args.host):
        print(f"warning: serving on {args.host} with no API key: anyone who reaches this address can use the model "
              "(--api-key or BLOCKSPEC_API_KEY sets one)", file=sys.stderr)
    import uvicorn
    from uvicorn.logging import DefaultFormatter

    from blockspec.cli_options import build_llm, speculative_config
    from blockspec.server.app import create_app
    from blockspec.server.async_engine import freezing_after

    names = args.served_model_name or [args.model]

    def engine_failed(message: str) -> None:
        print(f"error: {message}", file=sys.stderr)
        server.should_exit = True

    def ready(_: Any) -> None:
        log.info("blockspec serve ready on %s://%s:%d%s, model %s, %s", "https" if args.ssl_keyfile else "http",
                 args.host, port, args.root_path, " / ".join(names), describe_speculation(speculative_config(args)))

    # the server's own lines (ready, throughput) in uvicorn's format, at --log-level
    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(args.log_level.upper())
    log.propagate = False
    load = functools.partial(build_llm, args)  # pickles, for the engine process (which freezes after it)
    app = create_app(load if args.engine_process else freezing_after(load), names, on_engine_error=engine_failed,
                     engine_process=args.engine_process, config=config, on_ready=ready)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, root_path=args.root_path,
                                           log_level=args.uvicorn_log_level or args.log_level,
                                           timeout_keep_alive=args.timeout_keep_alive,
                                           timeout_graceful_shutdown=args.shutdown_timeout, ssl_keyfile=args.ssl_keyfile,
                                           ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                                           ssl_cert_reqs=args.ssl_cert_reqs))
    # uvicorn stops gracefully at the first SIGINT or SIGTERM, then raises that signal again for the code
    # around it (a KeyboardInterrupt's traceback, or death by SIGTERM): this is that code, and the stop
    # it asked for is done, so the repeat is dropped and the command exits 0
    dropped = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for sig, handler_before in dropped.items():
            signal.signal(sig, handler_before)
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
    return 2 if app.state.engine.load_error else 0


def ssl_problem(args: argparse.Namespace) -> str | None:
    """What keeps the TLS flags from working: a key without a certificate (or the reverse), a file that
    cannot be read, or a key and certificate that do not load together."""
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        return "--ssl-cert-reqs 1 or 2 checks client certificates against --ssl-ca-certs: give it"
    if not args.ssl_keyfile and not args.ssl_certfile:
        return "--ssl-ca-certs serves only with --ssl-keyfile and --ssl-certfile" if args.ssl_ca_certs else None
    if not (args.ssl_keyfile and args.ssl_certfile):
        return "HTTPS needs both --ssl-keyfile and --ssl-certfile"
    import ssl

    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None and not os.access(path, os.R_OK):
            return f"{flag} {path}: no such file, or not readable"
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (ssl.SSLError, ValueError) as exc:
        return f"--ssl-certfile {args.ssl_certfile} and --ssl-keyfile {args.ssl_keyfile} do not load: {exc}"
    return None


def describe_speculation(cfg: dict[str, Any] | None) -> str:
    """The ready line's account of speculation."""
    if cfg is None:
        return "speculation off (no --draft-model)"
    k = cfg.get("num_speculative_tokens") or "the drafter's default"
    adaptive = "adaptive: each step verifies 0 to K drafts" if cfg.get("adaptive_draft_length", True) \
        else "pinned by --no-adaptive-draft-length"
    return f"speculation {cfg['method']} with {cfg['model']} (K = {k}, {adaptive})"
