"""Starting `dsv4 serve` for tests: as a subprocess of the real CLI (port 0, the port read from its
log), or in-process under uvicorn on a thread (to reach into the engine)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


class ServerProcess:
    """`python -m dsv4.cli serve ...` with its log in a file; ``url`` once it listens."""

    def __init__(self, *args: str, env: dict | None = None):
        self.log_path = Path(tempfile.mkstemp(prefix="dsv4-serve-", suffix=".log")[1])
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "dsv4.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.url = self._wait_for_port(120)

    def _wait_for_port(self, timeout: float) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(r"dsv4 serve on (http://\S+?:\d+)", self.log())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsv4 serve exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise TimeoutError(f"dsv4 serve did not start:\n{self.log()}")

    def wait_ready(self, timeout: float = 180) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"dsv4 serve exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.1)
        raise TimeoutError(f"dsv4 serve never became ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class InProcessServer:
    """The app for an already-loaded ``LLM`` under uvicorn on a thread."""

    def __init__(self, llm, model_names=("tiny",), api_key: str | None = None, **app_kwargs):
        import uvicorn

        from dsv4.serve.app import create_app
        from dsv4.serve.server import setup_logging
        setup_logging("info")
        self.app = create_app(llm, model_names=list(model_names), api_key=api_key, **app_kwargs)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        end = time.monotonic() + 60
        while not self.server.started and time.monotonic() < end:
            time.sleep(0.02)
        self.state = self.app.state.dsv4

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def metric(text: str, name: str) -> float:
    """The value of one unlabeled-or-single-series metric in a Prometheus text page."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    if m is None:
        raise KeyError(name)
    return float(m.group(1))
