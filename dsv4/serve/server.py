"""Running the app under uvicorn: logging, start-up while the model loads, SIGTERM drain.

The socket opens at once and answers 503 while the model loads on a thread. The first SIGTERM
(or Ctrl-C) drains: new requests get 503, running ones may finish for ``shutdown_timeout``
seconds, the rest are aborted (their streams end), then the server exits with status 0. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

from .app import create_app

log = logging.getLogger("dsv4.serve")


def setup_logging(level: str = "info") -> None:
    """One stderr handler for ``dsv4.*`` loggers (uvicorn keeps its own)."""
    logger = logging.getLogger("dsv4")
    logger.setLevel(level.upper())
    if not any(getattr(h, "_dsv4", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._dsv4 = True
        logger.addHandler(handler)
        logger.propagate = False


class DrainingServer(uvicorn.Server):
    """uvicorn's server with our shutdown: drain first, then exit 0 (uvicorn alone would close the
    socket, wait for connections without a deadline, and re-raise the signal)."""

    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float):
        super().__init__(config)
        self.state, self.shutdown_timeout = state, shutdown_timeout
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining or self.state.status not in ("ready",):
            self.should_exit = True
            if self._draining:
                self.force_exit = True
            return
        self._draining = True
        log.info("received %s: draining (up to %.1f s)", signal.Signals(sig).name, self.shutdown_timeout)
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True


def run_server(load: Callable[[], Any] | Any, *, model_names: list[str], host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, shutdown_timeout: float = 30.0, log_level: str = "info",
               access_log: bool = False, sock=None, default_seed: int | None = None, stream_interval: int = 1) -> int:
    """Serve until a signal drains and stops the server; returns the exit status 0. When the model
    could not be loaded (or the engine not started on it) the server stops at once and the error is
    re-raised for the CLI to print, once."""
    setup_logging(log_level)
    app = create_app(load, model_names=model_names, api_key=api_key, default_seed=default_seed,
                     stream_interval=stream_interval)
    state = app.state.dsv4
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_keep_alive=30, timeout_graceful_shutdown=max(shutdown_timeout, 1.0) + 5)
    server = DrainingServer(config, state, shutdown_timeout)

    def failed(e: BaseException) -> None:
        server.should_exit = True

    state.on_load_error = failed
    log.info("dsv4 serve on http://%s:%d (the model loads in the background; /health says when it is ready)",
             host, port)
    server.run(sockets=[sock] if sock is not None else None)
    if state.load_error is not None:
        raise state.load_error
    return 0
