"""Names, permissions and sweeps of node-wide resources (common/private_resources.py): names
carry uid, host tag and pid; a sweep removes only our own names of dead processes; private
directories refuse ancestors another user could replace."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from sglang_swift.common import private_resources as pr
from sglang_swift.common.process import host_tag


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_shm_names_say_whose_they_are():
    """A name made here parses back to this process; other users' and hosts' names do not."""
    name = pr.shm_name("swift")
    assert name.startswith(f"swift_u{os.getuid()}_h{host_tag()}_p{os.getpid()}_")
    assert pr.shm_owner_pid(name) == os.getpid()
    assert pr.shm_name("swift") != name
    other_user = name.replace(f"_u{os.getuid()}_", f"_u{os.getuid() + 1}_")
    assert pr.shm_owner_pid(other_user) is None
    assert pr.shm_owner_pid(name.replace(f"_h{host_tag()}_", "_hzzzzzz_")) is None
    assert pr.shm_owner_pid("sglang_loads_1e79e671135a_05442cef.shm") is None
    with pytest.raises(ValueError, match="letters and digits"):
        pr.shm_name("a_b")


def test_shm_sweep_removes_only_our_names_of_dead_processes(tmp_path):
    """Of a dead process's name, a live process's name, another uid's name, a foreign name
    and a directory, only the first is removed."""
    dead, tag, uid = _dead_pid(), host_tag(), os.getuid()
    names = {
        "dead": f"swift_u{uid}_h{tag}_p{dead}_0123456789ab",
        "live": f"swiftpool_u{uid}_h{tag}_p{os.getpid()}_0123456789ab",
        "other_uid": f"swift_u{uid + 1}_h{tag}_p{dead}_0123456789ab",
        "foreign": f"sem.mp-{dead}",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / f"swift_u{uid}_h{tag}_p{dead}_ffffffffffff").mkdir()
    assert pr.sweep_shm(os.getpid(), shm_dir=str(tmp_path)) == []  # only that pid's
    assert pr.sweep_shm(shm_dir=str(tmp_path)) == [names["dead"]]
    left = set(os.listdir(tmp_path))
    assert left == set(names.values()) - {names["dead"]} | {
        f"swift_u{uid}_h{tag}_p{dead}_ffffffffffff"
    }


def test_socket_sweep_removes_dead_processes_sockets_only(tmp_path):
    """A socket file named for a dead pid goes; ours and a regular file of that name stay."""
    dead = _dead_pid()
    mine = tmp_path / pr.socket_name("aa")
    gone = tmp_path / f"bb.h{host_tag()}.p{dead}.sock"
    fake = tmp_path / f"cc.h{host_tag()}.p{dead}.sock"
    for path in (mine, gone):
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()  # the file stays, as after a SIGKILL
    fake.write_bytes(b"")
    assert pr.sweep_sockets(str(tmp_path)) == [gone.name]
    assert mine.exists() and fake.exists() and not gone.exists()


def test_private_dir_refuses_replaceable_ancestors(tmp_path):
    """A 0700 directory is created under a sticky or private parent, refused under a parent
    others may write to, and refused when it is itself open to others."""
    ok = tmp_path / "ok" / "rdv"
    pr.ensure_private_dir(str(ok))
    assert os.stat(ok).st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(pr.PrivatePathError, match="chmod go-w"):
        pr.ensure_private_dir(str(shared / "rdv"))
    os.chmod(shared, 0o1777)  # sticky, like /tmp: others cannot rename what is ours
    pr.ensure_private_dir(str(shared / "rdv"))
    os.chmod(ok, 0o750)
    with pytest.raises(pr.PrivatePathError, match="chmod 700"):
        pr.ensure_private_dir(str(ok))
