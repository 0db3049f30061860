"""Datasets in S3-compatible object storage (rust_loader/storage.rs), against a real S3
server started on localhost (moto's server mode, in its own process) and a fault-injecting
HTTP proxy in front of it (503s, connections cut before the response): the same documents,
checksums and batches as the local copy, and one clear line for what cannot be read."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import losses_by_step

from pytrain import _loader
from pytrain.data import TokenLoader

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")
from s3_local import BUCKET, MotoServer, Proxy, client, ensure_bucket, env, upload  # noqa: E402


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 server in a process of its own; yields its endpoint URL."""
    server = MotoServer()
    yield server.url
    server.close()


@pytest.fixture
def aws_env(monkeypatch):
    def use(endpoint: str) -> None:
        for key, value in env(endpoint).items():
            monkeypatch.setenv(key, value)

    return use


def documents(ds) -> list[tuple[int, ...]]:
    dtype = np.uint16 if ds.dtype == "uint16" else np.uint32
    out = []
    for f in range(ds.n_frames):
        data, lengths = ds.read_frame(f)
        ids = np.frombuffer(data, dtype=dtype)
        out += [tuple(x.tolist()) for x in np.split(ids, np.cumsum(lengths)[:-1])]
    return out


def batches(path, n: int, **kw) -> list[np.ndarray]:
    loader = TokenLoader(path, seq_len=64, batch_size=4, seed=3, threads=2, **kw)
    out = []
    for b in itertools.islice(loader, n):
        out.append(b.inputs.clone().numpy())
        b.release()
    loader.close()
    return out


def test_a_mixture_of_a_remote_and_a_local_dataset_reads_as_two_local_ones(
    s3_server, aws_env, small_corpus
):
    train, val = small_corpus
    aws_env(s3_server)
    url = upload(s3_server, train, "mixed")
    weights = {"web": 0.7, "code": 0.3}
    got = batches({"web": url, "code": str(val)}, 16, weights=weights)
    want = batches({"web": str(train), "code": str(val)}, 16, weights=weights)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


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
    proxy = Proxy(s3_server, every=3, cut=7)
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
    client(s3_server).delete_object(Bucket=BUCKET, Key=f"missing/{shard}")
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


def test_a_frame_damaged_on_the_way_is_fetched_again(s3_server, aws_env, small_corpus):
    train, _ = small_corpus
    url = upload(s3_server, train, "damaged")
    local = _loader.Dataset(str(train))
    _, offset, length, _ = local.frame_location(0)
    proxy = Proxy(s3_server, damage=f"bytes={offset}-{offset + length - 1}")
    try:
        aws_env(proxy.url)
        got = _loader.Dataset(url).read_frame(0)
    finally:
        proxy.close()
    assert proxy.faults["damaged"] == 1  # the first answer was bad, the second served
    assert got == local.read_frame(0)


def test_a_refused_request_is_one_line_without_the_secret(s3_server, aws_env, monkeypatch):
    """A permanent error (403) is not retried for minutes: one line naming the object, and
    nothing of the credentials in it."""
    proxy = Proxy(s3_server, every=1, status=403)
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


AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION",
                 "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SKIP_SIGNATURE")  # fmt: skip


def test_the_shared_aws_files_give_the_key_and_the_endpoint(
    s3_server, small_corpus, tmp_path, monkeypatch
):
    """Where the environment names no access key, the AWS CLI's files do (`aws configure`):
    AWS_PROFILE's keys in the credentials file, its region and endpoint_url in the config
    file. A proxy that refuses every request not signed with the profile's key proves the
    key, and only the profile names the proxy. With no key anywhere (and no instance
    metadata service), one line says where to put one."""
    train, _ = small_corpus
    url = upload(s3_server, train, "profile")
    for key in AWS_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    credentials, config = tmp_path / "credentials", tmp_path / "config"
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "minio")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    proxy = Proxy(s3_server, key_id="AKIDFROMPROFILE")
    try:
        config.write_text(f"[profile minio]\nregion = us-east-1\nendpoint_url = {proxy.url}\n")
        credentials.write_text(
            "[minio]\naws_access_key_id = AKIDFROMPROFILE\naws_secret_access_key = s3cret-5678\n"
        )
        remote = _loader.Dataset(url)
        assert documents(remote) == documents(_loader.Dataset(str(train)))
        assert proxy.faults["passed"] > 0 and proxy.faults["refused"] == 0
        credentials.write_text("[other]\naws_access_key_id = AKIDFROMPROFILE\n"
                               "aws_secret_access_key = s3cret-5678\n")  # fmt: skip
        with pytest.raises(_loader.RemoteError) as e:
            _loader.Dataset(url)
    finally:
        proxy.close()
    line = str(e.value)
    assert line.startswith(f"{url}/manifest.json: reading it:") and "\n" not in line, line
    assert "no AWS credentials" in line and "AWS_PROFILE" in line, line
    assert "s3cret-5678" not in line


def _train(data: str, val: str, out: Path, environ: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytrain.train", "--data.path", data, "--data.val_path", val,
           "--out_dir", str(out), "--name", "run", "--max_steps", "4", "--eval_every", "2",
           "--eval_batches", "2", "--log_every", "1", "--samples", "1", "--sample_tokens", "8",
           "--model.n_layer", "1", "--model.n_head", "2", "--model.d_model", "32",
           "--data.seq_len", "64", "--data.batch_size", "2", "--data.frames_per_block", "1",
           "--device", "cpu", "--no-tensorboard", "--no-progress", "--deterministic"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=300)


@pytest.mark.slow
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
    user_env = {**os.environ, **env(s3_server), "OMP_NUM_THREADS": "1"}
    tool = [sys.executable, "-m", "pytrain.pack_shards"]
    r = subprocess.run([*tool, "verify", url], capture_output=True, text=True, env=user_env)
    n_tokens = _loader.Dataset(str(local)).n_tokens
    assert r.returncode == 0 and r.stdout.startswith(f"{url}: OK"), r.stderr
    assert f"{n_tokens:,} tokens" in r.stdout
    r = subprocess.run([*tool, "inspect", url], capture_output=True, text=True, env=user_env)
    assert r.returncode == 0 and f"tokens      {n_tokens:,}" in r.stdout, r.stderr
    remote = _train(url, val_url, tmp_path / "remote", user_env)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert "--- sample 1 ---" in remote.stdout
    kept = tmp_path / "remote" / "run" / "tokenizer.json"
    assert kept.read_bytes() == (local / "tokenizer.json").read_bytes()
    mine = _train(str(local), str(val), tmp_path / "local", user_env)
    assert mine.returncode == 0, mine.stderr[-3000:]
    losses = [
        losses_by_step((tmp_path / w / "run" / "train.log").read_text())
        for w in ("remote", "local")
    ]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    # A bucket that does not exist: one line naming it, no traceback.
    bad = _train("s3://no-such-bucket/x", val_url, tmp_path / "bad", user_env)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "s3://no-such-bucket/x" in bad.stderr.strip().splitlines()[-1]


def test_the_frame_cache_serves_later_reads_stays_bounded_and_refetches_a_bad_copy(
    s3_server, aws_env, small_corpus, tmp_path
):
    train, _ = small_corpus
    url = upload(s3_server, train, "cached")
    local = _loader.Dataset(str(train))
    proxy = Proxy(s3_server)
    aws_env(proxy.url)
    cache = tmp_path / "cache"
    want = batches(str(train), 10**6, num_epochs=1)
    try:
        first = batches(url, 10**6, num_epochs=1, cache_dir=str(cache), cache_gb=1.0)
        fetched = proxy.faults["passed"]
        again = batches(url, 10**6, num_epochs=1, cache_dir=str(cache), cache_gb=1.0)
        # The second epoch asked the store for the manifest, footers and indexes only.
        shards = len([p for p in train.iterdir() if p.suffix == ".tks"])
        assert proxy.faults["passed"] - fetched <= 1 + 2 * shards
        frames = sorted((cache / local.manifest_hash).iterdir())
        assert len(frames) == local.n_frames
        # A copy gone bad on the local disk is dropped and fetched again.
        bad = bytearray(frames[0].read_bytes())
        bad[len(bad) // 2] ^= 0xFF
        frames[0].write_bytes(bytes(bad))
        mended = batches(url, 10**6, num_epochs=1, cache_dir=str(cache), cache_gb=1.0)
        assert frames[0].read_bytes() != bytes(bad)
        # A bound of three frames' bytes: the cache never holds more.
        small = tmp_path / "small"
        limit = 3 * max(p.stat().st_size for p in frames)
        bounded = batches(url, 10**6, num_epochs=1, cache_dir=str(small), cache_gb=limit / 1e9)
        held = sum(p.stat().st_size for p in (small / local.manifest_hash).iterdir())
        assert 0 < held <= limit
    finally:
        proxy.close()
    for got in (first, again, mended, bounded):
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


def test_pack_shards_writes_to_s3_and_uploads_a_dataset_manifest_last(s3_server, aws_env, tmp_path):
    """`pack-shards ... -o s3://...` (packed in a temporary directory, then uploaded) gives
    the documents of the same pack on local disk; a second pack there is refused in one
    line; `pack-shards upload` sends a finished dataset, its large shard in parts."""
    import json
    import os

    texts = [f"document {i}: " + "some words of text " * (i % 17 + 1) for i in range(300)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    user_env = {**os.environ, **env(s3_server)}
    ensure_bucket(s3_server)
    tool = [sys.executable, "-m", "pytrain.pack_shards"]
    url = f"s3://{BUCKET}/packed"
    common = [str(corpus), "--tokenizer", "byte", "--no-progress"]
    r = subprocess.run([*tool, *common, "-o", url], capture_output=True, text=True, env=user_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith(f"-> {url}")
    local = tmp_path / "local"
    r = subprocess.run([*tool, *common, "-o", str(local)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    aws_env(s3_server)
    assert documents(_loader.Dataset(url)) == documents(_loader.Dataset(str(local)))
    again = subprocess.run([*tool, *common, "-o", url], capture_output=True, text=True,
                           env=user_env)  # fmt: skip
    assert again.returncode == 3 and "holds a dataset already" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    # A finished dataset with a shard over the 16 MiB part size: a multipart upload.
    big = tmp_path / "big"
    _loader.write_synthetic(str(big), 4000, mu=8.0, sigma=0.5, vocab=60000,
                            docs_per_shard=100_000, seed=1)  # fmt: skip
    assert max(p.stat().st_size for p in big.glob("*.tks")) > 16 << 20
    up = subprocess.run([*tool, "upload", str(big), f"s3://{BUCKET}/big"],
                        capture_output=True, text=True, env=user_env)  # fmt: skip
    assert up.returncode == 0, up.stderr
    remote = _loader.Dataset(f"s3://{BUCKET}/big")
    remote.verify()  # every frame and every whole file against the manifest
    assert remote.manifest_hash == _loader.Dataset(str(big)).manifest_hash
