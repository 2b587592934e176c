"""Which SGLang engine a process of the CPU venv runs: decided once, as `import sglang` starts.

SGLang reads SGLANG_USE_CPU_ENGINE while its modules import (`is_cpu()` is cached at import time),
before it parses a single flag, so no ServerArgs hook can decide it. The venv's `.pth` installs
`ImportTrigger`, which calls `apply_engine_choice()` the moment `sglang` is about to be imported:
processes that never import SGLang probe nothing, and torch is never imported here.

Precedence, first match wins:
1. SGLANG_USE_CPU_ENGINE already in the environment: set by the user, or inherited from the
   process that decided (the launcher's scheduler and detokenizer see the launcher's answer);
2. an explicit `--device` on the command line: `cpu` turns the CPU engine on (SGLang needs both),
   anything else leaves it off;
3. detection: the CPU engine when `accelerator.find_accelerator` finds nothing SGLang could use.
An automatic choice is written back to the environment (the value, and CHOICE_ENV with its reason)
so every process started from here inherits the same answer; a user's value is never rewritten.
"""

from __future__ import annotations

import os
import sys
from collections import namedtuple
from collections.abc import Callable, MutableMapping, Sequence

from . import SHIM_DIR

# This module is imported at every interpreter start of the CPU venv: only modules Python has
# already loaded by then are imported at the top (no dataclasses, typing, importlib.abc, ast);
# the detection (`accelerator`) is imported when a choice is actually made.

ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
CHOICE_ENV = "SWIFTCACHE_CPU_ENGINE_CHOICE"  # "<engine value> <reason>", only for automatic choices


class EngineChoice(namedtuple("EngineChoice", "cpu_engine automatic reason")):
    """The engine a process runs (`cpu_engine`), whether this layer chose it (`automatic`; False
    when SGLANG_USE_CPU_ENGINE was the user's), and why, in words (`reason`)."""

    __slots__ = ()

    @property
    def env_value(self) -> str:
        return "1" if self.cpu_engine else "0"


def explicit_device(argv: Sequence[str]) -> str | None:
    """The value of `--device X` / `--device=X` in argv, if given (the last one wins, as
    argparse)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--device="):
            found = arg.split("=", 1)[1]
    return found


def recorded_choice(environ: MutableMapping[str, str]) -> EngineChoice | None:
    """The choice already in the environment (None: nobody decided yet)."""
    value = environ.get(ENGINE_ENV)
    if value is None:
        return None
    recorded_value, _, reason = environ.get(CHOICE_ENV, "").partition(" ")
    if recorded_value == value and reason:  # written by an automatic choice, not edited since
        return EngineChoice(value == "1", True, reason)
    return EngineChoice(value == "1", False, f"{ENGINE_ENV}={value} was set by the user")


def choose_engine(environ: MutableMapping[str, str], argv: Sequence[str],
                  read_facts: Callable[[], object] | None = None) -> EngineChoice:
    """Decide without writing anything (precedence in the module docstring). `read_facts`, a
    stand-in for `accelerator.read_host_facts` returning HostFacts, is for tests."""
    recorded = recorded_choice(environ)
    if recorded is not None:
        return recorded
    device = explicit_device(argv)
    if device is not None:
        on_cpu = device.split(":")[0] == "cpu"
        return EngineChoice(on_cpu, True, f"--device {device} was given")
    from .accelerator import find_accelerator, read_host_facts, why_none

    facts = (read_facts or read_host_facts)()
    accelerator = find_accelerator(facts, environ)
    if accelerator is not None:
        return EngineChoice(False, True, f"{accelerator} is available")
    return EngineChoice(True, True, f"no accelerator found: {why_none(facts)}")


def apply_engine_choice(environ: MutableMapping[str, str] | None = None,
                        argv: Sequence[str] | None = None) -> EngineChoice:
    """Decide, record an automatic choice in the environment, and on the CPU engine put the
    `sgl_kernel` stand-in first on sys.path. Idempotent."""
    environ = os.environ if environ is None else environ
    choice = choose_engine(environ, sys.argv if argv is None else argv)
    if choice.automatic and ENGINE_ENV not in environ:
        environ[ENGINE_ENV] = choice.env_value
        environ[CHOICE_ENV] = f"{choice.env_value} {choice.reason}"
    if choice.cpu_engine:
        put_stand_in_first()
    return choice


def put_stand_in_first() -> None:
    """The pure-torch `sgl_kernel` stand-in ahead of anything else named so (idempotent)."""
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))


class ImportTrigger:
    """A sys.meta_path finder that finds nothing: it runs `apply_engine_choice()` once, just
    before the first `import sglang` executes, and lets the normal finders import it."""

    def __init__(self) -> None:
        self.fired = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sglang" and not self.fired:
            self.fired = True
            try:
                apply_engine_choice()
            except Exception as exc:  # an import hook must never break `import sglang`
                print(f"SwiftCache CPU compat: could not choose SGLang's engine ({exc!r}); SGLang "
                      f"runs as stock. Set {ENGINE_ENV}=1 for its CPU engine.", file=sys.stderr)
        return None  # let the normal finders import the module


def install_import_trigger() -> None:
    """Install the trigger (idempotent); a no-op once SGLang is already imported."""
    if "sglang" in sys.modules or any(isinstance(f, ImportTrigger) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, ImportTrigger())
