"""Which SwiftCache hooks a live server's scheduler process registered, read from its log.

Each SGLang process prints one line naming what the plugin registered in it (`plugin.REGISTERED`).
Invariants: a server started WITHOUT --enable-swiftcache registers no SwiftCache hook and no
backend in its scheduler process (the flag's two hooks live in the launcher only); the same server
WITH the flag registers the `swiftcache` backend there, and a plain SwiftCache server (no lending,
borrowing, layer stream or instruments) only the loop's step (its tree's metrics).
"""

from __future__ import annotations

import re

import psutil
import pytest
from integration.harness import LocalServer

from sglang_swift.integration import plugin

pytestmark = pytest.mark.integration


def scheduler_registrations(server: LocalServer) -> list[str]:
    """What the plugin registered in the server's scheduler process (SGLang titles it
    `sglang::scheduler...`), as that process's line in the server log lists it."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    (scheduler,) = [p for p in children if " ".join(p.cmdline()).startswith("sglang::scheduler")]
    found = re.search(rf"^{re.escape(plugin.REGISTERED)} {scheduler.pid}: ([^\[\n]*)",
                      server.log_text(), re.MULTILINE)
    assert found, f"no registration line of the scheduler (pid {scheduler.pid}) in the log"
    return [name.strip() for name in found.group(1).split(",")]


@pytest.mark.parametrize("swiftcache", [False, True], ids=["stock", "swiftcache"])
def test_a_scheduler_registers_only_what_its_server_uses(tiny_model, tmp_path, monkeypatch,
                                                        swiftcache):
    monkeypatch.delenv("SWIFTCACHE_CONFIG", raising=False)
    monkeypatch.delenv("SWIFTCACHE_INSTRUMENTS", raising=False)
    with LocalServer(tiny_model, swiftcache=swiftcache, log_path=tmp_path / "server.log") as s:
        registered = scheduler_registrations(s)
    plain = [plugin._short(plugin.tp.SCHEDULER_STEP),
             f"radix cache backend '{plugin.BACKEND_NAME}'"]
    assert registered == (plain if swiftcache else [plugin.NOTHING])
