"""Datasets in S3-compatible object storage (rust_loader/storage.rs), against a real S3
server started on localhost (moto's server mode, in its own process) and a fault-injecting
HTTP proxy in front of it (503s, connections cut before the response): the same documents,
checksums and batches as the local copy, and one clear line for what cannot be read."""

from __future__ import annotations

import http.client
import http.server
import itertools
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pytrain import _loader
from pytrain.data import TokenLoader

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

BUCKET = "corpus"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server in a process of its own; yields its endpoint URL."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


def _client(endpoint: str):
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="test", aws_secret_access_key="test")  # fmt: skip


def upload(endpoint: str, local: Path, prefix: str) -> str:
    """Every file of a dataset, the manifest last (readers never see half a dataset)."""
    s3 = _client(endpoint)
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    files = sorted(p for p in local.iterdir() if p.name != "manifest.json")
    for p in [*files, local / "manifest.json"]:
        s3.upload_file(str(p), BUCKET, f"{prefix}/{p.name}")
    return f"s3://{BUCKET}/{prefix}"


@pytest.fixture
def aws_env(monkeypatch):
    def use(endpoint: str) -> None:
        for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
                           "AWS_ALLOW_HTTP": "true"}.items():  # fmt: skip
            monkeypatch.setenv(key, value)

    return use


class FaultProxy:
    """An HTTP proxy in front of the S3 server that answers every `every`-th request with
    `status` (503: slow down), and cuts the connection of every `cut`-th one before any
    response."""

    def __init__(self, upstream: str, every: int = 3, cut: int = 5, status: int = 503):
        host, port = upstream.removeprefix("http://").split(":")
        count = itertools.count(1)
        self.faults = {"503": 0, "cut": 0, "passed": 0}
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                n = next(count)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if n % cut == 0:
                    proxy.faults["cut"] += 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if n % every == 0:
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
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def documents(ds) -> list[tuple[int, ...]]:
    dtype = np.uint16 if ds.dtype == "uint16" else np.uint32
    out = []
    for f in range(ds.n_frames):
        data, lengths = ds.read_frame(f)
        ids = np.frombuffer(data, dtype=dtype)
        out += [tuple(x.tolist()) for x in np.split(ids, np.cumsum(lengths)[:-1])]
    return out


def batches(path: str, n: int) -> list[np.ndarray]:
    loader = TokenLoader(path, seq_len=64, batch_size=4, seed=3, threads=2)
    out = []
    for b in itertools.islice(loader, n):
        out.append(b.inputs.clone().numpy())
        b.release()
    loader.close()
    return out


def test_a_dataset_in_s3_reads_as_its_local_copy(s3_server, aws_env, small_corpus):
    train, _ = small_corpus
    aws_env(s3_server)
    url = upload(s3_server, train, "same")
    local, remote = _loader.Dataset(str(train)), _loader.Dataset(url)
    assert (remote.n_docs, remote.n_tokens, remote.n_frames) == (
        local.n_docs,
        local.n_tokens,
        local.n_frames,
    )
    assert remote.manifest_hash == local.manifest_hash  # the same dataset for a saved state
    remote.verify()  # every frame's and every file's checksum, read remotely
    assert documents(remote) == documents(local)
    got, want = batches(url, 12), batches(str(train), 12)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_reads_through_503s_and_cut_connections_lose_and_repeat_nothing(
    s3_server, aws_env, small_corpus
):
    train, _ = small_corpus
    url = upload(s3_server, train, "faults")
    proxy = FaultProxy(s3_server, every=3, cut=7)
    try:
        aws_env(proxy.url)
        remote = _loader.Dataset(url)
        assert documents(remote) == documents(_loader.Dataset(str(train)))
        got = batches(url, 12)
    finally:
        proxy.close()
    assert proxy.faults["503"] > 3 and proxy.faults["cut"] > 1, proxy.faults  # faults were met
    want = batches(str(train), 12)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_missing_object_is_one_line_naming_it(s3_server, aws_env, small_corpus):
    train, _ = small_corpus
    aws_env(s3_server)
    url = upload(s3_server, train, "missing")
    shard = sorted(p.name for p in train.iterdir() if p.suffix == ".tks")[0]
    _client(s3_server).delete_object(Bucket=BUCKET, Key=f"missing/{shard}")
    with pytest.raises(_loader.RemoteError) as e:
        _loader.Dataset(url)
    assert str(e.value) == f"{url}/{shard}: its footer: no such object"
    with pytest.raises(
        _loader.RemoteError,
        match=r"s3://corpus/nothing-here/manifest.json: reading it: no such object",
    ):
        _loader.Dataset(f"s3://{BUCKET}/nothing-here")


def test_a_corrupted_remote_frame_is_refused_by_its_checksum(
    s3_server, aws_env, small_corpus, tmp_path
):
    train, _ = small_corpus
    aws_env(s3_server)
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in train.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    local = _loader.Dataset(str(bad))
    shard, offset, length, _ = local.frame_location(0)
    data = bytearray((bad / shard).read_bytes())
    data[offset + length // 2] ^= 0xFF
    (bad / shard).write_bytes(bytes(data))
    url = upload(s3_server, bad, "corrupt")
    with pytest.raises(
        _loader.CorruptShardError,
        match=rf"corrupt shard {url}/{shard} frame 0: frame checksum mismatch",
    ):
        _loader.Dataset(url).read_frame(0)


def test_a_refused_request_is_one_line_without_the_secret(s3_server, aws_env, monkeypatch):
    """A permanent error (403) is not retried for minutes: one line naming the object, and
    nothing of the credentials in it."""
    proxy = FaultProxy(s3_server, every=1, cut=10**9, status=403)
    try:
        aws_env(proxy.url)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-right-secret-1234")
        t0 = time.perf_counter()
        with pytest.raises(_loader.RemoteError) as e:
            _loader.Dataset(f"s3://{BUCKET}/same")
    finally:
        proxy.close()
    line = str(e.value)
    assert line.startswith("s3://corpus/same/manifest.json: reading it:") and "\n" not in line, line
    assert "not-the-right-secret-1234" not in line
    assert time.perf_counter() - t0 < 10


def _train(data: str, val: str, out: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytrain.train", "--data.path", data, "--data.val_path", val,
           "--out_dir", str(out), "--name", "run", "--max_steps", "4", "--eval_every", "2",
           "--eval_batches", "2", "--log_every", "1", "--samples", "1", "--sample_tokens", "8",
           "--model.n_layer", "1", "--model.n_head", "2", "--model.d_model", "32",
           "--data.seq_len", "64", "--data.batch_size", "2", "--data.frames_per_block", "1",
           "--device", "cpu", "--no-tensorboard", "--no-progress", "--deterministic"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_training_verify_and_inspect_take_s3_urls(s3_server, small_corpus, tmp_path):
    """What a user runs on a dataset in a bucket: pack-shards verify and inspect, then the
    trainer (training and validation sets remote, samples decoded with the dataset's
    tokenizer, which the run directory keeps); its losses equal those of the local copy."""
    import os
    import shutil

    from pytrain.data.tokenizer import train_bpe

    train, val = small_corpus
    local = tmp_path / "train"
    shutil.copytree(train, local)
    train_bpe(["a few words of text, and a few more"] * 20, 300).save(str(local / "tokenizer.json"))
    url, val_url = upload(s3_server, local, "user/train"), upload(s3_server, val, "user/val")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server, "AWS_ALLOW_HTTP": "true",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    tool = [sys.executable, "-m", "pytrain.pack_shards"]
    r = subprocess.run([*tool, "verify", url], capture_output=True, text=True, env=env)
    n_tokens = _loader.Dataset(str(local)).n_tokens
    assert r.returncode == 0 and r.stdout.startswith(f"{url}: OK"), r.stderr
    assert f"{n_tokens:,} tokens" in r.stdout
    r = subprocess.run([*tool, "inspect", url], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and f"tokens      {n_tokens:,}" in r.stdout, r.stderr
    remote = _train(url, val_url, tmp_path / "remote", env)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert "--- sample 1 ---" in remote.stdout
    kept = tmp_path / "remote" / "run" / "tokenizer.json"
    assert kept.read_bytes() == (local / "tokenizer.json").read_bytes()
    mine = _train(str(local), str(val), tmp_path / "local", env)
    assert mine.returncode == 0, mine.stderr[-3000:]
    losses = [
        re.findall(r"step (\d+) loss (\S+)", (tmp_path / w / "run" / "train.log").read_text())
        for w in ("remote", "local")
    ]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    # A bucket that does not exist: one line naming it, no traceback.
    bad = _train("s3://no-such-bucket/x", val_url, tmp_path / "bad", env)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "s3://no-such-bucket/x" in bad.stderr.strip().splitlines()[-1]
