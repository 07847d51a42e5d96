"""A Hugging Face Hub on 127.0.0.1 that answers what huggingface_hub asks, for the tests of model pulls.

`GET /api/models/{repo}` (the listing: commit, files with sizes, LFS sha256 and git blob ids), `HEAD` and `GET`
`/{repo}/resolve/{revision}/{file}` (ETag, X-Repo-Commit, Content-Length, byte ranges), and the Hub's errors
(401 for a gated repository without the token `TOKEN`, and for any other token; 404 with its X-Error-Code for a
missing repository or file). Faults a test sets:
`cut` (the next GET of a file sends half of it and drops the connection; later ones get 503 until cleared),
`stall` (a GET sends half, then waits until `release()`), `bad_sha` (the listing's sha256 is another file's).
Every request is kept in `requests` (method, path, the range's first byte, bytes sent)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".gguf", ".safetensors")
TOKEN = "hf_mock_token"  # the one token this Hub knows: it opens the gated repositories


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    commit: str = field(default_factory=lambda: os.urandom(20).hex())


@dataclass
class Seen:
    method: str
    path: str
    range_start: int | None
    sent: int


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class MockHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.faults: dict[str, str] = {}  # file name -> "cut" | "stall" | "bad_sha"
        self.requests: list[Seen] = []
        self._released = threading.Event()
        self._cut_done: set[str] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet: the tests read `requests`
                pass

            def do_GET(self):
                hub._answer(self, head=False)

            def do_HEAD(self):
                hub._answer(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, files: dict[str, bytes], gated: bool = False) -> Repo:
        self.repos[repo] = Repo(dict(files), gated)
        return self.repos[repo]

    def release(self) -> None:
        """Let stalled downloads go on (they write into a connection the killed client has closed)."""
        self._released.set()

    def clear(self) -> None:
        self.faults.clear()
        self._cut_done.clear()

    def gets(self, name: str) -> list[Seen]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + name)]

    # -----------------------------------------------------------------------------------------------------

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        auth = h.headers.get("Authorization")
        if auth and auth != f"Bearer {TOKEN}":  # as the Hub answers a token it does not know
            return self._error(h, 401, None, head, message="Invalid credentials in Authorization header")
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        if m and not head:
            return self._listing(h, m.group(1))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._file(h, m.group(1), m.group(3), head)
        self._error(h, 404, None, head)

    def _error(self, h, status: int, code: str | None, head: bool, commit: str | None = None,
               message: str | None = None) -> None:
        body = json.dumps({"error": message or code or "not found"}).encode()
        self.requests.append(Seen("HEAD" if head else "GET", h.path, None, 0))  # before the answer: a client reads it
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        if message:
            h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _listing(self, h, name: str) -> None:
        repo = self.repos.get(name)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", False)
        siblings = []
        for fname, data in repo.files.items():
            s = {"rfilename": fname, "size": len(data), "blobId": git_blob_id(data)}
            if fname.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data + (b"x" if self.faults.get(fname) == "bad_sha" else b"")).hexdigest()
                s["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
            siblings.append(s)
        body = json.dumps({"id": name, "modelId": name, "sha": repo.commit, "private": False,
                           "gated": "manual" if repo.gated else False, "siblings": siblings}).encode()
        self.requests.append(Seen("GET", h.path, None, len(body)))
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _file(self, h, name: str, fname: str, head: bool) -> None:
        repo = self.repos.get(name)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", head)
        if repo.gated and h.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(h, 401, "GatedRepo", head)
        data = repo.files.get(fname)
        if data is None:
            return self._error(h, 404, "EntryNotFound", head, repo.commit)
        fault = self.faults.get(fname)
        if not head and fault == "cut" and fname in self._cut_done:
            return self._error(h, 503, None, head)
        start = 0
        rng = h.headers.get("Range")
        if rng and (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())):
            start = int(m.group(1))
        lfs = fname.endswith(LFS_SUFFIXES)
        seen = Seen("HEAD" if head else "GET", h.path, start if rng and not head else None, 0)
        self.requests.append(seen)
        h.send_response(206 if start and not head else 200)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)}"')
        h.send_header("X-Repo-Commit", repo.commit)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(data) - (0 if head else start)))
        if start and not head:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        body = data[start:]
        if fault in ("cut", "stall"):
            half = max(len(data) // 2 - start, 0)
            seen.sent = half  # counted before it is written: the client may read it before this thread goes on
            h.wfile.write(body[:half])
            h.wfile.flush()
            if fault == "cut":
                self._cut_done.add(fname)
                h.close_connection = True
                h.connection.shutdown(2)  # the connection drops mid-file
                return
            self._released.wait(60)
            body = body[half:]
        seen.sent += len(body)
        try:
            h.wfile.write(body)
        except OSError:
            pass  # the client went away (a killed pull)
