"""The SGLang plugin: flag parsing, validation, config transport, backend selection, version
gate, and what each process registers."""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
import textwrap

import pytest

from sglang_swift.config import CONFIG_ENV, SwiftConfig, cli_options
from sglang_swift.integration import plugin


@pytest.fixture(scope="module")
def loaded_plugins():
    """SGLang's own plugin loader, as the launcher runs it (applies our hooks in this process)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


def _prepare(argv: list[str]):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", "/nonexistent-model", *argv])


def test_every_config_field_has_a_flag_and_defaults_round_trip():
    """Each configurable field is a --swiftcache-* option; a config survives its JSON transport."""
    flags = [flag for flag, _ in cli_options()]
    assert "--swiftcache-role" in flags and "--swiftcache-eviction-policy" in flags
    cfg = SwiftConfig(enabled=True, role="donor", max_borrow_blocks=7, lend_fraction=0.25)
    assert SwiftConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("kwargs, word", [
    ({"role": "lender"}, "role"), ({"lend_fraction": 1.5}, "lend-fraction"),
    ({"max_borrow_blocks": -1}, "max-borrow-blocks"),
    ({"eviction_policy": "fifo"}, "eviction-policy"),
    ({"heartbeat_interval_s": 2.0, "heartbeat_timeout_s": 1.0}, "heartbeat-timeout-s"),
    ({"relend_cooldown_s": -1.0}, "relend-cooldown-s"),
])
def test_config_rejects_bad_values_naming_the_option(kwargs, word):
    """A bad value raises ValueError whose message names the option."""
    with pytest.raises(ValueError, match=word):
        SwiftConfig(**kwargs)


def test_parse_converts_raw_values_and_the_frozen_config_is_never_rewritten():
    """`parse` turns CLI/JSON text into typed values; the constructor only validates."""
    cfg = SwiftConfig.parse(enabled=True, lend_fraction="0.5", max_borrow_blocks="8")
    assert cfg.lend_fraction == 0.5 and cfg.max_borrow_blocks == 8
    with pytest.raises(ValueError, match="max_borrow_blocks"):
        SwiftConfig(max_borrow_blocks="8")


def test_lends_and_borrows_are_derived_once_from_the_config():
    """Whether a server lends or borrows is a property of the config (role and sizes)."""
    assert SwiftConfig(lend_fraction=0.5).lends and not SwiftConfig(lend_fraction=0.5).borrows
    assert SwiftConfig(max_borrow_blocks=4).borrows
    assert SwiftConfig(max_borrow_blocks=4).uses_donation
    assert not SwiftConfig(role="borrower", lend_fraction=0.5).lends
    assert not SwiftConfig().uses_donation
    assert SwiftConfig(max_borrow_blocks=4).tree_config(16).donor
    assert not SwiftConfig().tree_config(16).donor


def test_a_plain_tree_steps_once_a_loop_for_its_metrics():
    """Without lending, borrowing or a host tier the tree still gets the loop's step (its work
    counters reach /metrics there), and nothing else."""
    hooks = plugin.server_hooks(SwiftConfig(enabled=True), plugin.debug_seam.Observers())
    assert [p.attr for p, _ in hooks] == [plugin.tp.SCHEDULER_STEP.attr]


def test_unknown_config_keys_are_refused():
    with pytest.raises(ValueError, match="unknown SwiftCache config keys"):
        SwiftConfig.from_json('{"enabled": true, "bogus": 1}')


def test_flag_selects_backend_and_carries_config(loaded_plugins, monkeypatch):
    """--enable-swiftcache picks the swiftcache backend and stores the config where children
    see it."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    sa = _prepare(["--enable-swiftcache", "--swiftcache-role", "donor",
                   "--swiftcache-eviction-policy", "cost_aware"])
    assert sa.radix_cache_backend == plugin.BACKEND_NAME
    cfg = plugin.config_for_server(sa)
    assert cfg.enabled and cfg.role == "donor" and cfg.eviction_policy == "cost_aware"
    # Spawned scheduler processes receive ServerArgs pickled: the config must survive that.
    clone = pickle.loads(pickle.dumps(sa))
    assert plugin.config_for_server(clone) == cfg


def test_hierarchical_cache_becomes_the_trees_host_tier(loaded_plugins, monkeypatch):
    """--enable-hierarchical-cache with the flag: HiCache's options stay as SGLang resolved them
    (for SwiftCache's host tier), the config says the tree has a host tier, and SGLang's own
    flag is cleared so its scheduler builds no HiCache tree beside SwiftCache's."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    sa = _prepare(["--enable-swiftcache", "--enable-hierarchical-cache", "--hicache-ratio", "3",
                   "--hicache-write-policy", "write_back", "--hicache-mem-layout", "layer_first"])
    cfg = plugin.config_for_server(sa)
    assert cfg.host_tier and not sa.enable_hierarchical_cache
    assert sa.hicache_ratio == 3 and sa.hicache_mem_layout == "layer_first"
    assert plugin.server_hooks(cfg, plugin.debug_seam.Observers()) != []  # loads and stores
    stock = _prepare(["--enable-hierarchical-cache"])  # without the flag: HiCache as shipped
    assert stock.enable_hierarchical_cache and stock.radix_cache_backend in (None, "")


def test_an_l3_backend_stays_set_for_the_scheduler_to_drive_below_the_host_tier(loaded_plugins):
    """`--hicache-storage-backend` with SwiftCache's host tier: HiCache's own flag is cleared
    (no second tree), the storage backend and its options stay, so SGLang's scheduler calls the
    tree's L3 members (integration/storage_hits.py)."""
    sa = _prepare(["--enable-swiftcache", "--enable-hierarchical-cache", "--hicache-write-policy",
                   "write_back", "--hicache-storage-backend", "file",
                   "--hicache-storage-prefetch-policy", "wait_complete"])
    assert plugin.config_for_server(sa).host_tier and not sa.enable_hierarchical_cache
    assert sa.hicache_storage_backend == "file"
    assert sa.hicache_storage_prefetch_policy == "wait_complete"


@pytest.mark.parametrize("argv, needle", [
    (["--hicache-write-policy", "write_through_selective"],
     "--hicache-write-policy write_through_selective"),
    (["--hicache-write-policy", "write_back", "--swiftcache-max-borrow-blocks", "8",
      "--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct"],
     "--hicache-mem-layout page_first_direct"),
])
def test_hicache_options_the_host_tier_cannot_honour_stop_the_launch(loaded_plugins, argv,
                                                                       needle):
    with pytest.raises(SystemExit, match=needle):
        _prepare(["--enable-swiftcache", "--enable-hierarchical-cache", *argv])


def test_without_flag_server_args_are_stock(loaded_plugins, monkeypatch):
    """Without the flag nothing changes: no backend override, no config attribute."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    sa = _prepare([])
    assert sa.radix_cache_backend in (None, "")
    assert getattr(sa, plugin.CONFIG_ATTR, None) is None


REGISTRATIONS = textwrap.dedent("""
    import json, os, sys
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang_swift.integration import debug_seam, plugin

    out = []
    for environ in json.loads(sys.argv[1]):
        HookRegistry.reset()
        debug_seam.reset()
        for name in set(environ) | {"SWIFTCACHE_CONFIG", "SWIFTCACHE_INSTRUMENTS"}:
            os.environ.pop(name, None)
        os.environ.update(environ)  # as the process would have inherited it
        assert plugin.register() == []
        hooks = [(target, kind.name, hook.__module__ + "." + hook.__qualname__)
                 for target, entries in sorted(HookRegistry._hooks.items())
                 for kind, hook, _ in entries]  # per target in registration order
        out.append({"hooks": hooks,
                    "backend": get_radix_cache_factory(plugin.BACKEND_NAME) is not None})
    print("REGISTRATIONS " + json.dumps(out))
""")


def _registrations(environs: list[dict]) -> list[dict]:
    """What `register()` puts in SGLang's HookRegistry (SwiftCache's own hooks: the CPU
    stand-in's is left out) and whether the backend is registered, in a fresh process, for each
    process environment in turn."""
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k not in (CONFIG_ENV, "SWIFTCACHE_INSTRUMENTS")}
    env["SGLANG_PLUGINS"] = "none"  # the entry point stays out: register() is called here
    proc = subprocess.run([sys.executable, "-c", REGISTRATIONS, json.dumps(environs)],
                          capture_output=True, text=True, timeout=300, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REGISTRATIONS ")), None)
    assert line is not None, proc.stderr[-3000:]
    found = json.loads(line.removeprefix("REGISTRATIONS "))
    for f in found:
        f["hooks"] = [tuple(h) for h in f["hooks"] if ".cpu_compat." not in h[2]]
    return found


def registrations_in_spawned_child(out_path: str, environ: dict) -> None:
    """Run in a multiprocessing child started by spawn, as SGLang starts its schedulers: call
    register() there and write what it registered (JSON) to `out_path`."""
    import json
    import os

    from sglang.srt.mem_cache.registry import get_radix_cache_factory
    from sglang.srt.plugins.hook_registry import HookRegistry

    os.environ.update(environ)
    assert plugin.register() == []
    hooks = [target for target, entries in sorted(HookRegistry._hooks.items())
             for _, hook, _ in entries if ".cpu_compat." not in hook.__module__]
    with open(out_path, "w") as f:
        json.dump({"hooks": hooks,
                   "backend": get_radix_cache_factory(plugin.BACKEND_NAME) is not None}, f)


@pytest.mark.parametrize("enabled", [False, True], ids=["stock", "swiftcache"])
def test_a_spawned_process_registers_no_flag_hook(tmp_path, monkeypatch, enabled):
    """A process SGLang spawns (scheduler, detokenizer) never parses the command line: it
    registers no SwiftCache hook at all when the server runs without the flag, and only the
    backend and its configuration's hooks with it (a plain tree: the loop's step, for its
    metrics), never the flag's two."""
    import json
    import multiprocessing

    monkeypatch.setenv("SGLANG_PLUGINS", "none")  # inherited: register() is called by hand
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv("SWIFTCACHE_INSTRUMENTS", raising=False)
    environ = {CONFIG_ENV: SwiftConfig(enabled=True).to_json()} if enabled else {}
    out = tmp_path / "registered.json"
    child = multiprocessing.get_context("spawn").Process(
        target=registrations_in_spawned_child, args=(str(out), environ))
    child.start()
    child.join(timeout=300)
    assert child.exitcode == 0
    found = json.loads(out.read_text())
    want = [plugin.tp.SCHEDULER_STEP.target] if enabled else []
    assert found == {"hooks": want, "backend": enabled}


def test_each_process_registers_only_what_its_server_uses():
    """Without SwiftCache in a process (no CONFIG_ENV), SwiftCache registers the flag's two
    hooks and no backend; a plain SwiftCache server (no lending, borrowing, layer stream or
    instruments) adds the backend and the loop's step (its metrics), no pool or forward wrapper;
    each feature adds
    exactly its own hooks; an instrument's forward observer adds the seam's forward hook, last."""
    from sglang_swift.integration import touchpoints as tp

    def config(**kw) -> dict:
        return {CONFIG_ENV: SwiftConfig(enabled=True, **kw).to_json()}

    instruments = {"SWIFTCACHE_INSTRUMENTS": "benchmarks.instruments.traces:install",
                   "SWIFTCACHE_FORWARD_TRACE": "/dev/null"}
    stream = {"layer_stream": "host", "layer_stream_resident_fraction": 0.5}
    stock, plain, streamed, lending, borrowing, observed, both = _registrations([
        {}, config(), config(**stream), config(role="donor", lend_fraction=0.5),
        config(role="borrower", max_borrow_blocks=8), instruments,
        {**config(**stream), **instruments}])
    flag = [(tp.ADD_CLI_ARGS.target, "AFTER", f"{plugin.__name__}._after_add_cli_args"),
            (tp.FROM_CLI_ARGS.target, "AFTER", f"{plugin.__name__}._after_from_cli_args")]
    assert stock == {"hooks": flag, "backend": False}
    step = (tp.SCHEDULER_STEP.target, "BEFORE", f"{plugin.__name__}._before_scheduler_step")
    assert plain == {"hooks": sorted(flag + [step]), "backend": True}

    def added(found: dict) -> set[str]:
        return {target for target, _, _ in found["hooks"]} - {t for t, _, _ in flag}

    assert added(streamed) == {p.target for p in (
        tp.SCHEDULER_STEP, tp.CONFIG_FROM_BUDGET, tp.BUILD_MHA_POOL, tp.BUILD_ALLOCATOR,
        tp.MODEL_FORWARD, tp.VALIDATE_INPUT)}
    assert added(lending) == {tp.SCHEDULER_STEP.target, tp.KV_POOL_BUFFERS.target,
                              tp.KV_POOL_LATENT_BUFFERS.target}
    assert added(borrowing) == {tp.SCHEDULER_STEP.target, tp.BATCH_BUILT.target,
                                tp.BATCH_RAN.target}
    seam = (tp.MODEL_FORWARD.target, "AROUND", "sglang_swift.integration.debug_seam.around_forward")
    assert sorted(observed["hooks"]) == sorted(flag + [seam])
    forward = [h for h in both["hooks"] if h[0] == tp.MODEL_FORWARD.target]
    assert forward == [(tp.MODEL_FORWARD.target, "AROUND",
                        "sglang_swift.layer_stream.hooks.around_model_forward"), seam]


@pytest.mark.parametrize("argv, needle", [
    (["--enable-swiftcache", "--swiftcache-role", "lender"], "--swiftcache-role"),
    (["--enable-swiftcache", "--swiftcache-lend-fraction", "abc"], "--swiftcache-lend-fraction"),
    (["--enable-swiftcache", "--swiftcache-block-tokens", "-16"], "--swiftcache-block-tokens"),
])
def test_bad_cli_values_are_argparse_errors_naming_the_option(loaded_plugins, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        _prepare(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--swiftcache-role", "donor"], "without --enable-swiftcache"),
    (["--enable-swiftcache", "--radix-cache-backend", "flexkv"], "cannot be combined"),
    (["--enable-swiftcache", "--swiftcache-heartbeat-interval-s", "5"], "heartbeat-timeout-s"),
])
def test_inconsistent_options_stop_with_a_message(loaded_plugins, argv, needle):
    with pytest.raises(SystemExit, match=needle):
        _prepare(argv)


def test_backend_without_flag_explains_the_fix(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    with pytest.raises(plugin.SwiftCacheUnavailable, match="--enable-swiftcache"):
        plugin.config_for_server(argparse.Namespace())


def test_check_reports_wrong_version_and_missing_targets():
    from sglang_swift.integration import touchpoints as tp

    gone = tp.TouchPoint("sglang.srt.no_such_module.Thing", tp.Kind.AFTER, "", "", "")
    problems = plugin.check_sglang("0.5.22", [tp.ADD_CLI_ARGS, gone])
    assert any("0.5.22" in p and plugin.PINNED_SGLANG in p for p in problems)
    assert any("sglang.srt.no_such_module.Thing" in p for p in problems)
    assert plugin.check_sglang(plugin.PINNED_SGLANG) == []


def test_unsupported_version_refuses_to_start_loudly(tmp_path):
    """On a version mismatch: a loud stderr message at registration, and the flag stops start-up."""
    script = textwrap.dedent("""
        from sglang_swift.cpu_compat import activate_in_process
        activate_in_process()
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang_swift.integration import plugin
        problems = plugin.register(sglang_version="0.4.0")
        assert problems, problems
        HookRegistry.apply_hooks()
        from sglang.srt.server_args import prepare_server_args
        prepare_server_args(["--model-path", "/nonexistent", "--enable-swiftcache"])
        print("SERVER WOULD HAVE STARTED")
    """)
    env = {k: v for k, v in __import__("os").environ.items()}
    env["SGLANG_PLUGINS"] = "none"  # keep the entry point out: we call register() ourselves
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180, env=env)
    assert "SwiftCache plugin DISABLED" in proc.stderr
    assert "sglang 0.4.0 is installed" in proc.stderr
    assert "--enable-swiftcache refused" in proc.stderr
    assert "SERVER WOULD HAVE STARTED" not in proc.stdout
    assert proc.returncode != 0
