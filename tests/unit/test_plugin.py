"""The SGLang plugin: flag parsing, validation, config transport, backend selection, version gate."""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
import textwrap

import pytest

from sglang_swift.integration import plugin
from sglang_swift.config import CONFIG_ENV, SwiftConfig, cli_options


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
    ({"max_borrow_blocks": -1}, "max-borrow-blocks"), ({"eviction_policy": "fifo"}, "eviction-policy"),
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
    assert SwiftConfig(max_borrow_blocks=4).borrows and SwiftConfig(max_borrow_blocks=4).uses_donation
    assert not SwiftConfig(role="borrower", lend_fraction=0.5).lends
    assert not SwiftConfig().uses_donation
    assert SwiftConfig(max_borrow_blocks=4).tree_config(16).donor
    assert not SwiftConfig().tree_config(16).donor


def test_unknown_config_keys_are_refused():
    with pytest.raises(ValueError, match="unknown SwiftCache config keys"):
        SwiftConfig.from_json('{"enabled": true, "bogus": 1}')


def test_flag_selects_backend_and_carries_config(loaded_plugins, monkeypatch):
    """--enable-swiftcache picks the swiftcache backend and stores the config where children see it."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    sa = _prepare(["--enable-swiftcache", "--swiftcache-role", "donor",
                   "--swiftcache-eviction-policy", "cost_aware"])
    assert sa.radix_cache_backend == plugin.BACKEND_NAME
    cfg = plugin.config_for_server(sa)
    assert cfg.enabled and cfg.role == "donor" and cfg.eviction_policy == "cost_aware"
    # Spawned scheduler processes receive ServerArgs pickled: the config must survive that.
    clone = pickle.loads(pickle.dumps(sa))
    assert plugin.config_for_server(clone) == cfg


def test_without_flag_server_args_are_stock(loaded_plugins, monkeypatch):
    """Without the flag nothing changes: no backend override, no config attribute."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    sa = _prepare([])
    assert sa.radix_cache_backend in (None, "")
    assert getattr(sa, plugin.CONFIG_ATTR, None) is None


def test_backend_is_registered(loaded_plugins):
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    assert get_radix_cache_factory(plugin.BACKEND_NAME) is plugin.swiftcache_backend_factory


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
    problems = plugin.check_sglang("0.5.22", [plugin.ADD_CLI_ARGS, "sglang.srt.no_such_module.Thing"])
    assert any("0.5.22" in p and plugin.PINNED_SGLANG in p for p in problems)
    assert any("sglang.srt.no_such_module.Thing" in p for p in problems)
    assert plugin.check_sglang(plugin.PINNED_SGLANG, plugin.HOOK_TARGETS) == []


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
