"""Node secret, rendezvous directory permissions and configuration validation."""

from __future__ import annotations

import os
import stat

import pytest

from sglang_swift.control import discovery
from sglang_swift.control.auth import ensure_private_dir, load_or_create_secret, read_secret
from sglang_swift.control.control_config import ControlConfig, ControlConfigError


def test_secret_is_created_0600_and_reused(tmp_path):
    """A missing secret is generated with mode 0600; later loads return the same bytes."""
    path = str(tmp_path / "secret")
    first = load_or_create_secret(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(first) >= 32
    assert load_or_create_secret(path) == first


def test_secret_readable_by_others_is_refused(tmp_path):
    """A secret with group/other permissions is refused with the chmod fix in the message."""
    path = tmp_path / "secret"
    path.write_bytes(b"k" * 32)
    os.chmod(path, 0o644)
    with pytest.raises(ControlConfigError, match="chmod 600"):
        read_secret(str(path))


def test_short_secret_is_refused(tmp_path):
    path = tmp_path / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    with pytest.raises(ControlConfigError, match="regenerate"):
        read_secret(str(path))


def test_rendezvous_dir_is_private(tmp_path):
    """The rendezvous directory is created 0700, and a world-readable one is refused."""
    d = tmp_path / "rdv"
    ensure_private_dir(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(d, 0o755)
    with pytest.raises(ControlConfigError, match="chmod 700"):
        ensure_private_dir(str(d))


def test_config_validation_says_what_to_fix():
    with pytest.raises(ControlConfigError, match="agent_id"):
        ControlConfig(agent_id="a/b")
    with pytest.raises(ControlConfigError, match="heartbeat"):
        ControlConfig(agent_id="a", heartbeat_interval_s=2.0, heartbeat_timeout_s=1.0)
    with pytest.raises(ControlConfigError, match="transport"):
        ControlConfig(agent_id="a", transport="udp")
    assert ControlConfig(agent_id="a", rendezvous_dir="/x").secret_path == "/x/secret"


def test_epochs_grow_and_live_duplicate_ids_are_refused(tmp_path):
    """A restarted agent id gets a larger epoch; a live process holding the id blocks reuse."""
    d = str(tmp_path)
    e1 = discovery.next_epoch(d, "a")
    discovery.publish(d, discovery.PeerRecord("a", e1 + 10**9, os.getpid(), "ipc://x"))
    assert discovery.next_epoch(d, "a") > e1 + 10**9
    discovery.publish(d, discovery.PeerRecord("b", 5, os.getppid(), "ipc://y"))
    with pytest.raises(ControlConfigError, match="in use"):
        discovery.next_epoch(d, "b")


def test_long_rendezvous_paths_are_refused_for_ipc():
    with pytest.raises(ControlConfigError, match="107"):
        discovery.ipc_endpoint("/tmp/" + "x" * 120, "a")
