"""A real S3 server on localhost for tests and benchmarks: moto's server mode in a process of
its own, uploads through boto3 (the manifest last), and an HTTP proxy in front of it that
adds latency and faults (503s, connections cut before the response)."""

from __future__ import annotations

import http.client
import http.server
import itertools
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

BUCKET = "corpus"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
               "AWS_REGION": "us-east-1"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """moto's S3 server in a process of its own; `url` is its endpoint."""

    def __init__(self):
        port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                return
            except OSError:
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def env(endpoint: str) -> dict[str, str]:
    """The standard AWS variables that point a client at `endpoint` (plain HTTP)."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}


def client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="test", aws_secret_access_key="test")  # fmt: skip


def ensure_bucket(endpoint: str):
    """The test bucket, made where it is not there yet; returns the client."""
    s3 = client(endpoint)
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    return s3


def upload(endpoint: str, local: Path, prefix: str) -> str:
    """Every file of a directory, the manifest last (readers never see half a dataset)."""
    s3 = ensure_bucket(endpoint)
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != "manifest.json")
    last = [local / "manifest.json"] if (local / "manifest.json").is_file() else []
    for p in [*files, *last]:
        s3.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(local).as_posix()}")
    return f"s3://{BUCKET}/{prefix}"


class Proxy:
    """An HTTP proxy in front of the S3 server (many connections at once). Each request
    waits `delay_s` first (a far-away store's round trip); every `every`-th is answered
    with `status` (503: slow down; 403: access denied) and every `cut`-th connection is cut
    before any response (0: never). `damage`: a byte range ('bytes=A-B', as a ranged GET
    asks for it) whose first response has one byte flipped (a body damaged on the way).
    `key_id`: every request not signed with this access key is refused (403), as a store
    refuses another account's key (moto itself accepts any)."""

    def __init__(
        self,
        upstream: str,
        every: int = 0,
        cut: int = 0,
        status: int = 503,
        delay_s: float = 0.0,
        damage: str = "",
        key_id: str = "",
    ):
        host, port = upstream.removeprefix("http://").split(":")
        count = itertools.count(1)
        self.faults = {"503": 0, "cut": 0, "passed": 0, "damaged": 0, "refused": 0}
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                n = next(count)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if delay_s:
                    time.sleep(delay_s)
                if cut and n % cut == 0:
                    proxy.faults["cut"] += 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                signed_by = self.headers.get("Authorization", "")
                if key_id and f"Credential={key_id}/" not in signed_by:
                    proxy.faults["refused"] += 1
                    msg = b"<Error><Code>InvalidAccessKeyId</Code></Error>"
                    self.send_response(403)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if every and n % every == 0:
                    proxy.faults["503"] += 1
                    code = "SlowDown" if status == 503 else "AccessDenied"
                    msg = f"<Error><Code>{code}</Code></Error>".encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                hop = ("connection", "keep-alive", "proxy-connection", "te", "upgrade")
                headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                conn.request(self.command, self.path, body, {**headers, "Connection": "close"})
                r = conn.getresponse()
                data = r.read()
                if damage and self.headers.get("Range") == damage and not proxy.faults["damaged"]:
                    proxy.faults["damaged"] += 1
                    data = data[:-1] + bytes([data[-1] ^ 0xFF])
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                proxy.faults["passed"] += 1
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
