"""The test session's warm verifier (``patcher.verify.process.runner.warm_verifier``), kept alive.

A test worker holds one warm verifier for its whole session (tests/conftest.py). Two things could
end it before the session does, and a test that asserts a verify was *forked* then saw a fresh
process instead (``unreachable: [Errno 2] No such file or directory``):

- its idle exit: a server asked nothing for ``DDPATCH_WARM_IDLE`` seconds (default 900) exits and
  removes its socket, and a worker of a 40-minute suite can go longer than that between two
  verifies. The session's server is started with ``DDPATCH_WARM_IDLE=0``: it ends with its worker.
- a test that kills it or removes its folder. ``WarmServer.live()`` checks that the socket answers a
  connection and starts a new server where it does not.
"""

from __future__ import annotations

import contextlib
import os
import socket

from patcher.verify.child import warm
from patcher.verify.process import runner


def reachable(path: str | None) -> bool:
    """Whether a warm verifier listens at ``path`` (a connection is queued even while it imports)."""
    if not path:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(5)
            conn.connect(path)
    except OSError:
        return False
    return True


class WarmServer:
    """One warm verifier that never idles out, started again by ``live()`` when it is gone."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._stack: contextlib.ExitStack | None = None
        self.starts = 0

    def live(self) -> str:
        """The socket of a warm verifier that answers: this one, or a new one where it does not."""
        if not reachable(self.path):
            self.close()
            stack = contextlib.ExitStack()
            saved = {name: os.environ.pop(name, None) for name in (runner.WARM_ENV, warm.IDLE_ENV)}
            os.environ[warm.IDLE_ENV] = "0"  # read by the server at its start: it ends with this process, never idle
            try:
                self.path = stack.enter_context(runner.warm_verifier())
            finally:
                os.environ.pop(warm.IDLE_ENV, None)
                if saved[warm.IDLE_ENV] is not None:
                    os.environ[warm.IDLE_ENV] = saved[warm.IDLE_ENV]
            self._stack = stack
            self.starts += 1
        os.environ[runner.WARM_ENV] = self.path
        return self.path

    def close(self) -> None:
        """End the server (and unset ``DDPATCH_WARM_VERIFIER`` where it names it)."""
        stack, self._stack, self.path = self._stack, None, None
        if stack is not None:
            stack.close()
