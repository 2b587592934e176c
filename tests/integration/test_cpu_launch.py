"""A new user's launch in the CPU venv: no environment variables, no CPU flags.

Invariants: `python -m sglang.launch_server --model-path M --enable-swiftcache` (plus host/port)
serves a chat completion on a machine without an accelerator, and the launcher says in exactly one
log line that it chose SGLang's CPU engine, --device cpu and --attention-backend torch_native;
an explicit --attention-backend, an explicit SGLANG_USE_CPU_ENGINE=0 and an explicit --device win
over the automatic choice, through SGLang's real plugin loader and resolution.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from integration.harness import LocalServer, chat

from sglang_swift.cpu_compat.accelerator import find_accelerator, read_host_facts

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_accelerator(read_host_facts(), os.environ) is not None,
                       reason="checks the automatic choice on a machine without an accelerator"),
]
LOG_LINE = "SwiftCache CPU compat:"


def new_user_env() -> dict[str, str]:
    """This process's environment without anything the project or the test set-up adds
    (conftest's activate_in_process, TRITON_INTERPRET, HF offline switches)."""
    added = ("SGLANG_", "SWIFTCACHE_", "PYTHONPATH", "TRITON_INTERPRET", "HF_HUB_OFFLINE",
             "TRANSFORMERS_OFFLINE")
    return {k: v for k, v in os.environ.items() if not k.startswith(added)}


def test_new_user_command_serves_a_chat_completion(tiny_model, tmp_path):
    """The README's command, run as a new user would, serves; one line says what was chosen.

    No --max-total-tokens either: SGLang sizes the KV pool from free RAM, as a user would get.
    """
    server = LocalServer(tiny_model, swiftcache=True, cpu=False, max_total_tokens=None,
                         env=new_user_env(), log_path=tmp_path / "server.log")
    assert server.args[1:] == ["-m", "sglang.launch_server", "--model-path", str(tiny_model),
                               "--host", "127.0.0.1", "--port", str(server.port),
                               "--enable-swiftcache"]
    with server:
        reply = chat(server, [{"role": "user", "content": "Hello, who are you?"}], max_tokens=8)
        log = server.log_text()
    assert reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] > 0
    lines = [line for line in log.splitlines() if LOG_LINE in line]
    assert len(lines) == 1, lines
    for chosen in ("no accelerator found", "SGLANG_USE_CPU_ENGINE=1 (auto)", "--device cpu (auto)",
                   "--attention-backend torch_native (auto)"):
        assert chosen in lines[0], lines[0]
    assert "source=registered('swiftcache')" in log  # the flag still selects SwiftCache's tree


RESOLVE = """
import json, os, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
from sglang.srt.arg_groups.overrides import resolving_view
from importlib.util import find_spec
kernel = find_spec("sgl_kernel")
out = {"engine": os.environ.get("SGLANG_USE_CPU_ENGINE"),
       "choice": os.environ.get("SWIFTCACHE_CPU_ENGINE_CHOICE"),
       "stand_in": bool(kernel and "cpu_compat" in (kernel.origin or ""))}
if sys.argv[1] == "resolve":
    args = prepare_server_args(sys.argv[2:])
    try:
        args.resolve_once()
        view = resolving_view(args)
        out.update(device=view.device, attention_backend=view.attention_backend)
    except RuntimeError as exc:
        out["error"] = str(exc)
print("RESULT " + json.dumps(out))
"""


def _resolve(argv: list[str], **env: str) -> tuple[dict, str]:
    """Import SGLang, load its plugins and resolve `argv` in a fresh new-user process."""
    proc = subprocess.run([sys.executable, "-c", RESOLVE, *argv], capture_output=True, text=True,
                          env={**new_user_env(), **env}, timeout=300)
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and results, proc.stderr[-3000:]
    return json.loads(results[0][len("RESULT "):]), proc.stderr


def test_an_explicit_attention_backend_wins_and_the_rest_is_chosen(tiny_model):
    """--attention-backend triton stays triton after SGLang's resolution; device and engine are
    still chosen for the CPU, the stand-in is what `import sgl_kernel` finds, one line says so."""
    out, stderr = _resolve(["resolve", "--model-path", str(tiny_model),
                            "--attention-backend", "triton"])
    assert (out["device"], out["attention_backend"]) == ("cpu", "triton")
    assert out["engine"] == "1" and out["choice"].startswith("1 no accelerator found")
    assert out["stand_in"] is True
    lines = [ln for ln in stderr.splitlines() if LOG_LINE in ln]
    assert len(lines) == 1 and "--attention-backend triton (given)" in lines[0], lines


def test_an_explicit_engine_variable_wins(tiny_model):
    """SGLANG_USE_CPU_ENGINE=0 is the user's: stock SGLang, which finds no accelerator and says
    so."""
    out, stderr = _resolve(["resolve", "--model-path", str(tiny_model)],
                           SGLANG_USE_CPU_ENGINE="0")
    assert out["engine"] == "0" and out["choice"] is None
    assert "No accelerator" in out["error"]
    assert LOG_LINE not in stderr


def test_an_explicit_device_on_the_command_line_wins():
    """`--device cuda` is seen before SGLang imports: the CPU engine stays off, recorded as such
    for the processes the launcher would spawn."""
    out, _ = _resolve(["import-only", "--device", "cuda"])
    assert out["engine"] == "0" and out["choice"] == "0 --device cuda was given"
