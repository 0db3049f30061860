"""Signatures on what the trainer writes into a run directory and later loads as code
(Inductor's compile artifacts and its cache of compiled kernels), so that a run directory
copied from someone else runs none of it: its checkpoints resume (they load with torch's
weights-only unpickler) and it compiles afresh, saying why in one line.

The key is this user's: 32 random bytes in `signing.key` of pytrain's configuration
directory ($PYTRAIN_CONFIG_DIR, else $XDG_CONFIG_HOME/pytrain, else ~/.config/pytrain),
outside every run directory, made with mode 0600 the first time one is needed. A signed
blob is MAGIC, then HMAC-SHA256 of (what it is for, its bytes), then its bytes.

No torch at import: the CLI checks the run's Inductor cache before torch is imported."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

KEY_BYTES = 32
MAGIC = b"pytrain-signed-v1\n"
STAMP = ".pytrain-signature"
"""The file in a directory the trainer made that signs the directory itself (stamp_dir)."""


class NoKey(Exception):
    """This user's key cannot be read or made (the message says why, in one line)."""


class NotTrusted(Exception):
    """Data or a directory this user's key did not sign (the message says how)."""


def config_dir() -> Path:
    if d := os.environ.get("PYTRAIN_CONFIG_DIR"):
        return Path(d)
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "pytrain"


def key_path() -> Path:
    return config_dir() / "signing.key"


def key() -> bytes:
    """This user's key, made the first time (mode 0600: readable by this user only)."""
    path = key_path()
    if not path.exists():
        _make_key(path)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            st, data = os.fstat(fd), os.read(fd, KEY_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise NoKey(f"cannot read the signing key {path}: {e.strerror or e}") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        # A key others can read signs for them too; one that is not ours is not our key.
        raise NoKey(f"the signing key {path} is not this user's alone (owner uid {st.st_uid}, "
                    f"mode {st.st_mode & 0o777:o}): chmod 600 it, or remove it to make a new one")  # fmt: skip
    if len(data) != KEY_BYTES:
        raise NoKey(f"the signing key {path} is not {KEY_BYTES} bytes: remove it to make a new one")
    return data


def _make_key(path: Path) -> None:
    """Writes a new key under a temporary name and links it into place: the key file never
    exists half-written, and of two processes making one at once, the first one's stays."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: that one is the key
    except OSError as e:
        raise NoKey(f"cannot make the signing key {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _tag(k: bytes, purpose: str, data: bytes) -> bytes:
    return hmac.new(k, purpose.encode() + b"\0" + data, hashlib.sha256).digest()


def sign(data: bytes, purpose: str) -> bytes:
    """`data` signed for `purpose` (what it is, so that a signature is not taken for another)."""
    return MAGIC + _tag(key(), purpose, data) + data


def unsign(blob: bytes, purpose: str) -> bytes:
    """The data of a blob `sign` made with this user's key for `purpose`; else NotTrusted."""
    if not blob.startswith(MAGIC):
        raise NotTrusted(f"not signed with this user's key ({key_path()})")
    size = hashlib.sha256().digest_size
    tag, data = blob[len(MAGIC) : len(MAGIC) + size], blob[len(MAGIC) + size :]
    if not hmac.compare_digest(tag, _tag(key(), purpose, data)):
        raise NotTrusted(
            f"signed with another key than this user's ({key_path()}), or changed since"
        )
    return data


def _dir_tag(d: Path, purpose: str) -> str:
    """The signature of directory `d`: its real path and inode under this user's key. A copy
    elsewhere, or a directory put in its place, has another path or inode."""
    where = f"{os.path.realpath(d)}\0{os.stat(d).st_ino}".encode()
    return _tag(key(), purpose, where).hex()


def stamp_dir(d: Path, purpose: str) -> None:
    """Signs directory `d` as one this user's trainer made (a file in it, written atomically;
    every rank of a job writes the same)."""
    stamp = Path(d) / STAMP
    tmp = stamp.with_name(f"{STAMP}.tmp-{os.getpid()}")
    tmp.write_text(_dir_tag(Path(d), purpose) + "\n")
    os.replace(tmp, stamp)


def check_dir(d: Path, purpose: str) -> None:
    """Returns if `d` holds this user's stamp for `purpose`; else NotTrusted."""
    try:
        got = (Path(d) / STAMP).read_text().strip()
    except FileNotFoundError:
        raise NotTrusted(f"not signed with this user's key ({key_path()})") from None
    if not hmac.compare_digest(got, _dir_tag(Path(d), purpose)):
        raise NotTrusted(
            f"signed with another key than this user's ({key_path()}), or copied or moved since"
        )


def is_stamp(name: str) -> bool:
    """Whether a file name is the stamp or one of its temporaries (nothing of the cache)."""
    return name == STAMP or name.startswith(f"{STAMP}.tmp-")
