"""Headless Chromium (Debian's package) driven over the DevTools protocol, for page tests.

No browser download and no driver binary: the test launches /usr/bin/chromium itself, with a
fresh profile, and speaks the DevTools protocol over a WebSocket.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
)


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is missing: `make test` installs Debian's chromium package"
    return path


class Chromium:
    """One headless browser with one page. Use as a context manager."""

    def __init__(self, workdir: Path, width: int = 1280, height: int = 1100) -> None:
        self.profile = workdir / "chromium-profile"
        self.log = workdir / "chromium.log"
        self.size = f"--window-size={width},{height}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.ws: ClientConnection | None = None
        self._closing = ExitStack()
        self._next_id = 0
        self._events: list[str] = []
        self.console: list[str] = []

    def __enter__(self) -> Chromium:
        args = [chromium_path(), *FLAGS, self.size, f"--user-data-dir={self.profile}"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([*args, "about:blank"], stdout=log, stderr=log)
        try:
            port = self._devtools_port()
            pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
            self.ws = self._closing.enter_context(connect(url, max_size=None, open_timeout=10))
            self.call("Runtime.enable")
            self.call("Page.enable")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.close()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def _devtools_port(self, timeout: float = 30.0) -> int:
        """Chromium writes the port it chose into the profile once it listens."""
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium did not open its DevTools port: {self.log.read_text()}")

    def _receive(self) -> dict[str, Any]:
        """The next message; events are noted on the way (uncaught page errors in `console`)."""
        assert self.ws is not None
        message: dict[str, Any] = json.loads(self.ws.recv(timeout=60))
        method = message.get("method")
        if method is not None:
            self._events.append(method)
        if method == "Runtime.exceptionThrown":
            self.console.append(json.dumps(message["params"]["exceptionDetails"]))
        return message

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Sends one DevTools command and returns its result."""
        assert self.ws is not None
        self._next_id += 1
        self.ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = self._receive()
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message["result"])

    def navigate(self, url: str) -> None:
        """Opens `url` and waits for its load event."""
        self._events.clear()
        self.call("Page.navigate", url=url)
        while "Page.loadEventFired" not in self._events:
            self._receive()

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Polls `expression` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"never true: {expression}; page errors: {self.console}")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))
        return path
