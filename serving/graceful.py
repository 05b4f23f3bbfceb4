"""The uvicorn server of `kiln serve`, in a module of its own: `kiln serve` imports uvicorn only once the model has
started loading (kiln.serving.serve_cmd)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import uvicorn


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose SIGTERM / SIGINT handling ends in a normal exit (uvicorn re-raises the signal after its
    graceful shutdown, which would end the process with status 143 instead of 0) and starts the app's drain: /health
    503 at once, requests still running after `drain_timeout` seconds cut with an error (uvicorn's own graceful
    timeout is a few seconds longer, so the cut comes first)."""

    def __init__(self, config: uvicorn.Config, api, drain_timeout: float) -> None:
        super().__init__(config)
        self.api, self.drain_timeout = api, drain_timeout

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            self.api.begin_drain(self.drain_timeout)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
