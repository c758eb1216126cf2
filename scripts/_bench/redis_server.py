"""The result backend of the bench's Celery side: ``redis-server`` found (or installed with
``apt-get`` when missing and possible) and run on a free port of 127.0.0.1 without persistence.
The ``redis`` client library (the ``bench`` extra) is imported only when a server starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from scripts.lab.harness.processes import free_port

__all__ = ["RedisServer", "redis_server_binary"]


def redis_server_binary() -> tuple[str | None, str]:
    """The ``redis-server`` binary (installed with apt-get when missing and possible), and how
    it was found or why there is none."""
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )
    if found:
        return found, f"{found} (installed)"
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return None, "redis-server is not installed and apt-get cannot install it here (not root)"
    print("bench: redis-server is missing; installing it with apt-get", flush=True)
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "redis-server"]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            return None, f"`{' '.join(command)}` failed: {done.stderr.strip()[-500:]}"
    found = shutil.which("redis-server")
    if found is None:
        return None, "apt-get installed redis-server but no redis-server binary is on PATH"
    return found, f"{found} (installed by the bench with apt-get)"


class RedisServer:
    """``redis-server`` on a free port of 127.0.0.1, without persistence, as a subprocess."""

    def __init__(self, binary: str, log_path: Path) -> None:
        self.binary = binary
        self.log_path = log_path
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> RedisServer:
        import redis

        self.port = free_port()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return self
            except redis.exceptions.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server did not start on port {self.port} (see {self.log_path})"
                    ) from None
                time.sleep(0.05)

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, socket_timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
