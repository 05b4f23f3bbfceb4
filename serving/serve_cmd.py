"""`kiln serve`: load a model (artifact folder, HF folder, .gguf, or the embedded SmolLM2), start the engine and answer
the OpenAI-compatible API on uvicorn.

The socket is bound before the model loads (a busy port fails at once) and listens only once the engine is warm, so
nothing compiles after the server is reachable. SIGTERM or Ctrl+C stops accepting connections, lets running
requests finish for up to --shutdown-timeout seconds, aborts the rest, stops the engine and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn

from kiln.models.errors import KilnError
from kiln.targets.target import KV_DTYPES, WEIGHT_FORMATS

if TYPE_CHECKING:
    from kiln.serving.llm import AsyncLLM

log = logging.getLogger("kiln.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        nargs="?",
        default=None,
        help="an artifact folder, an HF model folder or a .gguf file (default: the embedded SmolLM2)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KILN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (env KILN_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients use (default: the source's name)",
    )
    p.add_argument("--max-request-bytes", type=int, default=8 * 2**20, help="larger bodies get 413 (default 8 MiB)")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may take to finish after SIGTERM before they are aborted",
    )
    p.add_argument(
        "--target",
        default="auto",
        help="hardware target of the artifact to build or load ('auto': the local devices; 'jit': no "
        "artifact, jit the model on the local device)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests allowed to wait for the engine; beyond it new requests get 429 with Retry-After",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        metavar="ORIGIN",
        help="CORS origins allowed to call the API ('*' for any; default: no CORS headers)",
    )
    g = p.add_argument_group("engine geometry (default: the target's; an existing artifact fixes them)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length in tokens")
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step (the largest bucket)")
    g.add_argument("--buckets", type=_buckets, default=None, help="token buckets, e.g. 16,64,256")
    g.add_argument("--kv-tokens", type=int, default=None, help="KV cache size in tokens")
    g.add_argument("--dtype", default=None, help="compute and KV dtype (float32, bfloat16)")
    g.add_argument("--kv-dtype", default=None, choices=KV_DTYPES, help="KV cache dtype when not --dtype's (fp8)")
    g.add_argument("--attention", default=None, help="force an attention implementation: reference, xla_cpu, ...")
    g.add_argument("--quantize", default=None, choices=WEIGHT_FORMATS, help="weight format (int8, int4)")
    g.add_argument("--decode-steps", type=int, default=None, help="decode tokens per dispatch when all decode")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per request")


def _buckets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive token counts")
    return values


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise KilnError(f"Cannot listen on {host}:{port} ({e.strerror or e}).") from None
    sock.set_inheritable(True)
    return sock


def _build_llm(args: argparse.Namespace) -> AsyncLLM:
    """The engine for args.source: an artifact folder as is; otherwise the artifact for --target (compiled into
    artifacts/ unless a matching one is there), or with --target jit the model jitted on the local device."""
    from kiln.serving.llm import AsyncLLM, build_engine

    geometry = dict(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        buckets=args.buckets,
        kv_tokens=args.kv_tokens,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        decode_steps=args.decode_steps,
        quantize=args.quantize,
        attention=args.attention,
    )
    geometry = {k: v for k, v in geometry.items() if v is not None}  # checked by kiln.compile.plan
    source = args.source
    if args.target != "jit" and not _is_artifact(source):
        from kiln.compile import ensure_artifact

        log.info("preparing the artifact for target %s", args.target)
        source = str(ensure_artifact(source, args.target, **geometry))
    names = args.served_model_name
    engine = build_engine(source, **geometry, enable_prefix_caching=not args.no_prefix_caching,
                          model_name=names[0] if names else None, warmup=True)  # fmt: skip
    return AsyncLLM(engine)


def _is_artifact(source: str | None) -> bool:
    return source is not None and os.path.isfile(os.path.join(source, "manifest.json"))


def _configure_logging(level: str, access: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("kiln")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    logging.getLogger("kiln.access").setLevel("INFO" if access else "WARNING")


def run(args: argparse.Namespace) -> int:
    from prometheus_client import disable_created_metrics

    from kiln.serving.app import ServerConfig, build_app

    disable_created_metrics()  # this process's metrics are kiln's; vLLM drops the *_created series too
    _configure_logging(args.log_level, not args.no_access_log)
    if args.max_request_bytes < 1 or args.shutdown_timeout < 0 or args.max_waiting_requests < 1:
        raise KilnError("--max-request-bytes and --max-waiting-requests must be positive, --shutdown-timeout >= 0.")
    sock = _bind(args.host, args.port)
    try:
        llm = _build_llm(args)
    except BaseException:
        sock.close()
        raise
    try:
        config = ServerConfig(
            served_model_names=tuple(args.served_model_name or ()),
            api_key=args.api_key or None,
            max_request_bytes=args.max_request_bytes,
            max_waiting_requests=args.max_waiting_requests,
            allowed_origins=tuple(args.allowed_origins),
            source=args.source,
        )
        app = build_app(llm, config)
        uv = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=5)  # fmt: skip
        host, port = sock.getsockname()[:2]
        log.info("serving %s on http://%s:%d (ready)", app.state.api.names[0], host, port)
        _GracefulServer(uv).run(sockets=[sock])
    finally:
        llm.shutdown()
        sock.close()
    log.info("stopped")
    return 0


class _GracefulServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM / SIGINT handling ends in a normal exit (uvicorn re-raises the signal after its
    graceful shutdown, which would end the process with status 143 instead of 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
