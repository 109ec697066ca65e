"""One bounded HTTP exchange with an engine: a deadline on the whole exchange and a cap on the answer's size.

``http.client`` rather than ``urllib.request``: the socket's timeout is set to what is left of the deadline
before every read, so a server that answers one byte at a time cannot hold a request past its deadline, and
an engine on 127.0.0.1 is never sent through an ``http_proxy`` the environment happens to set.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import EngineAnswerError, EngineUnreachable

#: What one generation may take (a CPU ``llama-server`` writes 64 tokens of a small pair in well under this).
GENERATE_TIMEOUT_S = 300.0
#: What a probe (``/props``, ``/v1/models``, ``/metrics``, ``/tokenize``) may take.
PROBE_TIMEOUT_S = 10.0
#: The largest answer read: a generation's JSON, or a ``/metrics`` page with its histograms.
MAX_ANSWER_BYTES = 16 * 2**20


@dataclass
class Answer:
    """An HTTP answer: its status, its body, and the address it came from (for messages)."""

    status: int
    body: bytes
    where: str

    def json(self) -> Any:
        try:
            return json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            head = self.body[:80].decode("utf-8", "replace").replace("\n", " ")
            raise EngineAnswerError(f"{self.where} answered HTTP {self.status} with no JSON: {head!r}") from None

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def error_message(self) -> str:
        """The engine's own error message, on one line: ``{"error": {"message": ...}}`` (llama.cpp, SGLang,
        newer vLLM), ``{"message": ...}`` (vLLM's and SGLang's ``ErrorResponse``), FastAPI's ``{"detail": ...}``."""
        try:
            data = json.loads(self.body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            data = None
        found: Any = None
        if isinstance(data, dict):
            err = data.get("error")
            found = err.get("message") if isinstance(err, dict) else err
            found = found or data.get("message") or data.get("detail")
        text = str(found) if found else self.body[:200].decode("utf-8", "replace")
        return " ".join(text.split()) or f"HTTP {self.status}"


def base_url(url: str) -> str:
    """``127.0.0.1:8080``, ``http://host:8000/v1/`` -> ``http://127.0.0.1:8080``, ``http://host:8000``: the server's
    root, which every client below appends its paths to."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EngineAnswerError(f"not an engine address: {url!r} (give http://HOST:PORT)")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def call(base: str, path: str, body: Any = None, *, timeout_s: float = PROBE_TIMEOUT_S,
         max_bytes: int = MAX_ANSWER_BYTES) -> Answer:
    """GET ``base + path`` (POST ``body`` as JSON when given), within ``timeout_s`` in all and ``max_bytes`` of answer.
    Any HTTP status is returned (the caller knows what a 404 or a 400 means for its engine); no answer at all
    raises :class:`EngineUnreachable`, an oversized one :class:`EngineAnswerError`."""
    parts = urlsplit(base)
    where = f"{base}{path}"
    deadline = time.monotonic() + timeout_s
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname, parts.port, timeout=timeout_s)
    data = None if body is None else json.dumps(body).encode("utf-8")
    headers = {"Accept": "application/json, text/plain"}
    if data is not None:
        headers["Content-Type"] = "application/json"

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    try:
        conn.connect()
        # getresponse() hands the socket to the response (conn.sock becomes None): keep our own handle
        sock = conn.sock
        sock.settimeout(left())
        conn.request("POST" if data is not None else "GET", parts.path + path, body=data, headers=headers)
        response = conn.getresponse()
        declared = response.getheader("Content-Length")
        if declared and declared.isdigit() and int(declared) > max_bytes:
            raise EngineAnswerError(f"{where} answered {int(declared)} bytes, over the {max_bytes}-byte bound")
        chunks, size = [], 0
        while True:
            remaining = left()  # past the deadline: TimeoutError, below
            try:
                sock.settimeout(remaining)
            except OSError:  # Python 3.13+ closes the connection's handle on a Connection: close answer;
                pass  # the response reads through its own, under the timeout set before the request
            chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise EngineAnswerError(f"{where} answered over {max_bytes} bytes: stopped reading")
            chunks.append(chunk)
        return Answer(response.status, b"".join(chunks), where)
    except ConnectionRefusedError:
        raise EngineUnreachable(f"nothing answers at {base} (connection refused): is the engine running there?") from None
    except (TimeoutError, socket.timeout):
        raise EngineUnreachable(f"{where} did not answer within {timeout_s:g} s") from None
    except socket.gaierror as exc:
        raise EngineUnreachable(f"cannot resolve {parts.hostname!r}: {exc.strerror or exc}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise EngineUnreachable(f"{where} failed: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    finally:
        conn.close()
