"""Child processes of the benchmarks: start one, wait for its ready line, stop it."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Child:
    """A started child process, the ready line's regex match, and its last output lines."""

    proc: subprocess.Popen
    match: re.Match
    tail: deque = field(default_factory=lambda: deque(maxlen=50))
    reader: threading.Thread | None = None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` seconds; then close its output pipe
        once the thread draining it has read to the end."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.reader is not None:
            self.reader.join(5)
        if self.proc.stdout is not None and (self.reader is None or not self.reader.is_alive()):
            self.proc.stdout.close()


def start_child(cmd: Sequence[str], ready: str, timeout_s: float = 300.0,
                env: dict[str, str] | None = None, cwd: str | None = None) -> Child:
    """Start ``cmd`` (stdout and stderr merged) and wait for a line matching ``ready``.

    Raises:
        RuntimeError: the process exited or no line matched within ``timeout_s`` seconds
            (the message holds its last output lines).
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=cwd, bufsize=1)
    tail: deque = deque(maxlen=50)
    found: list[re.Match] = []
    pattern = re.compile(ready)
    got = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # keep draining so the child never blocks on a full pipe
            tail.append(line.rstrip())
            if not found:
                m = pattern.search(line)
                if m:
                    found.append(m)
                    got.set()
        got.set()

    thread = threading.Thread(target=reader, daemon=True, name=f"child {cmd[0]}")
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not got.wait(0.2):
        if time.monotonic() > deadline:
            break
    if not found:
        child = Child(proc, None, tail, thread)
        child.stop(2)
        raise RuntimeError(f"{' '.join(cmd[:3])} did not become ready:\n" + "\n".join(tail))
    return Child(proc, found[0], tail, thread)
