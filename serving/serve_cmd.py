"""`kiln serve`: load a model (artifact folder, HF folder, .gguf, or the embedded SmolLM2), start the engine and answer
the OpenAI-compatible API on uvicorn.

The port opens at once and the model loads in a background thread: meanwhile /health answers 503 {"status":
"loading"} and /v1/* an OpenAI-shaped 503 (code model_loading), so a readiness probe and a load balancer see the
truth. The engine is attached only once it is warm (every program compiled or loaded and run once), so nothing
compiles after /health turns 200. A load that fails ends the process with its one-sentence error.

SIGTERM or Ctrl+C stops accepting connections and turns /health 503; running requests may finish for up to
--shutdown-timeout seconds, then what is left is cut (a stream ends with an in-band error event, code
server_shutdown, and `data: [DONE]`), the engine stops and the process exits 0.

Socket bounds (defaults in add_arguments): a request's headers must arrive within --timeout-header seconds and its
body within --timeout-body; beyond --limit-concurrency open connections a new one gets 503; idle keep-alive
connections close after 5 s.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING

from kiln.compile.compile_cmd import add_plan_arguments, plan_options
from kiln.models.errors import KilnError
from kiln.serving.reasoning import PARSERS as REASONING_PARSERS
from kiln.serving.tool_parsers import PARSERS

if TYPE_CHECKING:
    import uvicorn

    from kiln.serving.engine import Engine
    from kiln.serving.llm import AsyncLLM

log = logging.getLogger("kiln.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        nargs="?",
        default=None,
        help="an artifact folder, an HF model folder or a .gguf file (default: the embedded SmolLM2)",
    )
    p.add_argument("--model", default=None, help="the same as the positional source (as compile and generate take it)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0 picks a free one)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KILN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (env KILN_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        type=_names,
        default=None,
        metavar="NAME[,NAME...]",
        help="model name(s) clients use: comma-separated or the option repeated (default: the source's name)",
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
        action="append",
        type=_names,
        default=None,
        metavar="ORIGIN[,ORIGIN...]",
        help="CORS origins allowed to call the API, comma-separated or repeated ('*' for any; default: no CORS)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=1024,
        help="open connections at most; a new one beyond it gets 503 (default 1024)",
    )
    p.add_argument(
        "--timeout-header",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers before it is closed (default 10)",
    )
    p.add_argument(
        "--timeout-body",
        type=float,
        default=30.0,
        help="seconds a request's body may take to arrive before the request gets 408 (default 30)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="tool-call syntax of the model's output (default: recognised from the chat template)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split <think> reasoning into reasoning_content (default: off)",
    )
    g = p.add_argument_group("plan (default: the target's, as `kiln compile` plans it; an existing artifact fixes it)")
    add_plan_arguments(g)
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    m = p.add_argument_group("multi-host (kiln.serving.multihost): every host of a slice runs kiln serve ARTIFACT")
    m.add_argument("--multihost", action="store_true", help="join the TPU VM slice this host belongs to")
    m.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service (elsewhere than a TPU VM)")
    m.add_argument("--num-processes", type=int, help="processes in the slice")
    m.add_argument("--process-id", type=int, help="this process's index; 0 serves HTTP and schedules")


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing")
    return names


def _joined(groups: list[tuple[str, ...]] | None) -> tuple[str, ...]:
    """The names of a repeated comma-separated option, in order, without repeats."""
    return tuple(dict.fromkeys(n for group in groups or () for n in group))


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


def _build_engine(args: argparse.Namespace) -> Engine:
    """The engine for args.source: an artifact folder as is; otherwise the artifact for --target (compiled into
    artifacts/ unless a matching one is there), or with --target jit the model jitted on the local device."""
    from kiln.serving.llm import build_engine

    geometry = plan_options(args)  # checked by kiln.compile.plan
    source = args.source
    if args.target != "jit" and not _is_artifact(source):
        from kiln.compile import ensure_artifact

        log.info("preparing the artifact for target %s", args.target)
        source = str(ensure_artifact(source, args.target, **geometry))
    names = _joined(args.served_model_name)
    many = args.multihost or args.coordinator is not None  # every call of a program is announced first
    prefetch = getattr(args, "prefetch", None)  # kiln.serving.cli: the artifact's checks, started before jax's import
    if prefetch is not None and os.path.realpath(prefetch.folder) != os.path.realpath(source or ""):
        prefetch.close()
        prefetch = None
    engine = build_engine(source, **geometry, enable_prefix_caching=not args.no_prefix_caching,
                          model_name=names[0] if names else None, warmup=not many,
                          defer_programs=not many,  # a CPU artifact's larger buckets load after ready
                          prefetch=prefetch)  # fmt: skip
    if many:
        from kiln.serving import multihost

        multihost.lead(engine.runner)
        engine.runner.warmup()
    return engine


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
    _configure_logging(args.log_level, not args.no_access_log)
    positive = (args.max_request_bytes, args.max_waiting_requests, args.limit_concurrency, args.timeout_header,
                args.timeout_body)  # fmt: skip
    if min(positive) <= 0 or args.shutdown_timeout < 0:
        raise KilnError("--max-request-bytes, --max-waiting-requests, --limit-concurrency and the --timeout-* options "
                        "must be positive, --shutdown-timeout >= 0.")  # fmt: skip
    if args.model is not None and args.source is not None and args.model != args.source:
        raise KilnError(f"Two models given ({args.source} and --model {args.model}); give one.")
    args.source = args.source if args.source is not None else args.model
    many = args.multihost or any(v is not None for v in (args.coordinator, args.num_processes, args.process_id))
    if many:  # imported only here: jax before the socket is bound would delay a single host's start
        from kiln.serving import multihost

        multihost.requested(args.coordinator, args.num_processes, args.process_id, args.multihost)  # or one sentence
        if not _is_artifact(args.source):
            raise KilnError("Multi-host serving needs a compiled artifact (`kiln compile --target ...`) on every host.")
        multihost.initialize(args.coordinator, args.num_processes, args.process_id)
        import jax

        if jax.process_index() != 0:
            return multihost.follow(args.source)
    sock = _bind(args.host, args.port)
    # the model starts loading now, and the server's own modules import while it loads (uvicorn, starlette, the routes
    # and schemas: ~0.3-0.5 s of a start); the port answers once they are in (a connection before that waits in the
    # listen backlog)
    loader = _Loader(args, sock.getsockname()[:2])
    loader.start()
    # the server's imports wait until the loader has imported the engine's modules: both are Python holding the GIL,
    # so side by side they can only delay the load's start, which then runs mostly outside the GIL (SmolLM2, 2-core
    # machine at load average 5, four alternated pairs: imports phase 1.58 s median against 1.80, within the noise)
    loader.imported.wait(5.0)
    from prometheus_client import disable_created_metrics  # here: 16-24 ms that no longer delay the loader's start

    disable_created_metrics()  # this process's metrics are kiln's (before kiln.serving.metrics makes any); vLLM too
    import uvicorn

    from kiln.serving.app import ServerConfig, build_app
    from kiln.serving.graceful import GracefulServer
    from kiln.serving.transport import http_protocol

    config = ServerConfig(
        served_model_names=_joined(args.served_model_name),
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        max_waiting_requests=args.max_waiting_requests,
        allowed_origins=_joined(args.allowed_origins),
        source=args.source,
        body_timeout=args.timeout_body,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    app = build_app(None, config)  # loading: /health and /v1 answer 503 until the engine is attached
    uv = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="off",
                        timeout_graceful_shutdown=args.shutdown_timeout + 5, timeout_keep_alive=5,
                        http=http_protocol(args.timeout_header, args.limit_concurrency))  # fmt: skip
    server = GracefulServer(uv, app.state.api, args.shutdown_timeout)
    log.info("listening on http://%s:%d; loading the model", *sock.getsockname()[:2])
    loader.serve(app.state.api, server)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        loader.stop()
        if many:
            multihost.stop()
    loader.join(timeout=1.0)
    if loader.is_alive():  # stopped while loading: a thread inside XLA cannot be interrupted, nor outlive the process
        log.info("stopped while loading")
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)
    if loader.error is not None:
        raise loader.error
    log.info("stopped")
    return 0


def _cpu_only() -> None:
    """A cpu artifact on a machine where jax would find no accelerator (jax's own checks: no NVIDIA or AMD GPU device,
    no TPU on the PCI bus): start only jax's cpu platform, as JAX_PLATFORMS=cpu would, unless JAX_PLATFORMS is set.
    Where libtpu is installed (a TPU extra) jax otherwise starts its TPU client and gives up on it: 0.05-0.08 CPU-s
    of a SmolLM2 CPU start. A cpu artifact on a machine with an accelerator is still refused by the load."""
    if os.environ.get("JAX_PLATFORMS"):
        return
    import jax
    from jax._src import hardware_utils

    try:
        found = (hardware_utils.has_visible_nvidia_gpu() or hardware_utils.num_available_amd_gpus(stop_at=1)
                 or hardware_utils.num_available_tpu_chips_and_device_id()[0])  # fmt: skip
    except Exception:  # noqa: BLE001 (jax's internals differ: leave the platforms to jax)
        return
    if not found and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


def _adopt_early_client() -> bool:
    """Make the CPU client kiln.compile.checks.start_early_cpu made before jax's import jax's cpu backend (before
    anything asks jax for its devices), so that the executables deserialized on it meanwhile are the load's. False
    where there is none, or jax has its backends already."""
    from kiln.compile.checks import early_cpu_client

    client = early_cpu_client()
    if client is None:
        return False
    from jax._src import xla_bridge

    try:
        xla_bridge.register_backend_factory("cpu", lambda: client, priority=0, fail_quietly=False)
    except RuntimeError:  # "Backend cpu already initialized"
        return False
    return True


def _deserialize_for_first_device(blob: bytes):
    """An executable's bytes deserialized for jax's first device (a CPU artifact's), kiln's CPU kernels registered
    first (its programs name them): Prefetch.deserialize_first runs it on a thread of its own while this process
    imports kiln's modules and the server's, so that step_t16's deserialization (0.4-0.5 CPU-s, outside the GIL) no
    longer waits for them (artifact.load takes the result)."""
    import jax
    from jax._src.lib import xla_client as xc

    from kiln.models.kernels import cpu_quant

    cpu_quant.register()
    device = jax.devices()[0]
    return device.client.deserialize_executable(blob, executable_devices=xc.DeviceList((device,)))


def _start_device_client() -> None:
    """Start jax's device client (CUDA and the device memory pool on a GPU) on its own thread while the loader
    imports the engine's modules, which need no device: the 8B start on an H200 went from 6.66 to 6.03 s to /health
    200 (three alternated starts each, its manifest phase 0.84 -> 0.24 s); on the 2-core CPU it measured neutral.
    KILN_EARLY_CLIENT=0 turns it off."""
    try:
        import jax

        jax.devices()
    except Exception:  # noqa: BLE001 (the load meets the same error and reports it as one sentence)
        pass


class _Loader(threading.Thread):
    """Builds the engine while the server starts and then answers (503 loading), and attaches it once the server is
    handed over (serve); a failure stops the server and is re-raised by run()."""

    def __init__(self, args: argparse.Namespace, address: tuple) -> None:
        super().__init__(name="kiln-load", daemon=True)
        self.args, self.address = args, address
        self.api = self.server = None
        self.llm: AsyncLLM | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._served = threading.Event()
        self.imported = threading.Event()  # the engine's modules are in: the load itself runs mostly outside the GIL
        self._stopped = False

    def serve(self, api, server: uvicorn.Server) -> None:
        """The app's API to attach the engine to and the server to stop on a failure (the loader may be done)."""
        self.api, self.server = api, server
        self._served.set()

    def run(self) -> None:
        try:
            try:
                prefetch = getattr(self.args, "prefetch", None)
                if prefetch is not None and prefetch.platform() == "cpu":
                    _cpu_only()
                    if not _adopt_early_client():  # else its first programs are deserializing already
                        prefetch.deserialize_first(_deserialize_for_first_device)
                if os.environ.get("KILN_EARLY_CLIENT", "1") != "0":
                    threading.Thread(target=_start_device_client, name="kiln-client", daemon=True).start()
                import kiln.serving.llm  # noqa: F401
            finally:
                self.imported.set()
            engine = _build_engine(self.args)
        except BaseException as e:  # noqa: BLE001  (re-raised in the main thread: a KilnError is one sentence)
            self.error = e
            self._served.wait()
            self.server.should_exit = True
            return
        self._served.wait()
        # Python's cyclic GC, off since the start (kiln.serving.cli.readahead_artifact), back on: what the start
        # allocated moves to the permanent generation first, so no collection walks it again (a full one over the
        # start's ~200k objects takes 20-70 ms, which a first request would otherwise meet)
        gc.freeze()
        gc.enable()
        from kiln.serving.llm import AsyncLLM

        with self._lock:
            if self._stopped:  # the server stopped while we loaded
                return
            # the engine's thread starts now, not before the server is up: its idle clock (Later, the deferred
            # programs of a CPU start) must not run out while a slower server start keeps requests away
            llm = self.llm = AsyncLLM(engine)
            self.api.attach(llm)
        from kiln.serving.llm import startup_report

        log.info("serving %s on http://%s:%d (ready) %s", self.api.names[0], *self.address, startup_report(llm.engine))

    def stop(self) -> None:
        """The server has stopped: shut the engine down (or have it shut down as soon as it is built)."""
        with self._lock:
            self._stopped = True
            llm = self.llm
        if llm is not None:
            llm.shutdown()
