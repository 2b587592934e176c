"""The node secret: a 0600 file that every agent on the node (and `ctl`) must be able to read."""

from __future__ import annotations

import os
import secrets
import stat

from sglang_swift.common import private_resources
from sglang_swift.control.control_config import ControlConfigError

SECRET_BYTES = 32


def ensure_private_dir(path: str) -> None:
    """Create ``path`` 0700 if missing; refuse one that others can enter or that is not ours,
    or below a directory another user could replace (`common.private_resources`)."""
    try:
        private_resources.ensure_private_dir(path)
    except private_resources.PrivatePathError as exc:
        raise ControlConfigError(f"rendezvous dir: {exc}") from None


def read_secret(path: str) -> bytes:
    """Read the secret; refuse a file with group/other permissions or of the wrong size."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise ControlConfigError(
                f"secret {path} is mode {stat.S_IMODE(st.st_mode):o}; run `chmod 600 {path}` "
                "(and rotate it if others may have read it)"
            )
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(data) < SECRET_BYTES:
        raise ControlConfigError(f"secret {path} has {len(data)} bytes; delete it to regenerate")
    return data


def load_or_create_secret(path: str) -> bytes:
    """Return the node secret, generating it 0600 if missing (atomically, safe against races)."""
    try:
        return read_secret(path)
    except FileNotFoundError:
        pass
    if not os.path.isdir(os.path.dirname(path) or "."):
        raise ControlConfigError(
            f"secret {path}: its directory does not exist; create it "
            "(mode 0700) or point secret_file elsewhere"
        )
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secrets.token_bytes(SECRET_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another agent won the race; then we read theirs
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return read_secret(path)
