"""The node benchmark's `--busy-tp N`, without servers: every busy server (stock, SwiftCache, the
ideal) gets `--tp N` and its ranks' core binding, the donors get neither, the JSON names the busy
TP only when it is not 1, and a TP of 0 or one the busy model's heads cannot split is refused
with an error that names the option."""

import json

import pytest

from benchmarks.nodebench import cli, plan, runner
from sglang_swift.cpu_compat.engine_choice import ENGINE_ENV

SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=2048,
             dtype="float32")
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=2048, dtype="float32")


def _tp_of(args: list[str]) -> str | None:
    return args[args.index("--tp") + 1] if "--tp" in args else None


def test_busy_tp_reaches_every_busy_server_and_no_donor(monkeypatch, tmp_path):
    """With --busy-tp 2 the busy server of (a), (b) and (c) is launched with `--tp 2` and
    SGLANG_CPU_OMP_THREADS_BIND "0|1" (one core per rank); every donor, the twin's included,
    keeps TP 1 and no binding."""
    monkeypatch.setenv(ENGINE_ENV, "1")  # the CPU engine, decided without probing the host
    monkeypatch.delenv(plan.TP_BIND_ENV, raising=False)
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 2)
    _, p = cli.parse_args(["--quick", "--busy-tp", "2"])
    assert p.busy_tp == 2
    specs = (plan.stock_run(p), plan.swiftcache_run(p), plan.ideal_run(p, 512, 2048))
    for spec in specs:
        busy = runner.bench_server(tmp_path, spec, "busy", spec.busy_pool,
                                   spec.busy_args(p, "/rv", 512), p, tmp_path, False)
        assert _tp_of(busy.args) == "2", spec.name
        assert busy.env[plan.TP_BIND_ENV] == "0|1", spec.name
        assert busy.args[busy.args.index("--max-total-tokens") + 1] == str(spec.busy_pool)
        donor = runner.bench_server(tmp_path, spec, "donor", spec.donor_pool,
                                    spec.donor_args(p, "/rv"), p, tmp_path, False)
        assert _tp_of(donor.args) is None and plan.TP_BIND_ENV not in donor.env, spec.name
    borrower = specs[1].busy_args(p, "/rv", 512)
    assert borrower[borrower.index("--swiftcache-role") + 1] == "borrower"


def test_busy_tp_1_leaves_the_arguments_as_they_were():
    """The default adds no --tp and no binding: a TP 1 run launches what it launched before."""
    _, p = cli.parse_args(["--quick"])
    assert p.busy_tp == 1 and p.busy_env(2) == {}
    for spec in (plan.stock_run(p), plan.swiftcache_run(p)):
        assert _tp_of(spec.busy_args(p, "/rv", 512)) is None


def test_more_ranks_than_cores_share_them_round_robin():
    """Rank r is bound to core r mod cpus: --busy-tp 4 on two cores is "0|1|0|1"."""
    p = plan.NodePlan(busy_tp=4)
    assert p.busy_env(2) == {plan.TP_BIND_ENV: "0|1|0|1"}


def test_a_tp_below_one_is_a_usage_error_naming_the_option(capsys):
    """--busy-tp 0 (or negative) stops at argument parsing, naming --busy-tp."""
    for bad in ("0", "-2"):
        with pytest.raises(SystemExit) as stop:
            cli.parse_args(["--busy-tp", bad])
        assert stop.value.code == 2
        assert f"--busy-tp must be at least 1, got {bad}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="busy_tp"):
        plan.NodePlan(busy_tp=0)


def test_a_tp_the_heads_cannot_split_is_refused_naming_the_option_and_the_sizes():
    """The small model's 4 KV heads (8 query heads) split over 1, 2 or 4 ranks; 3 and 8 are
    refused with --busy-tp, the head counts and the sizes that work in the message."""
    small = plan.ModelFacts.from_config("small", SMALL)
    assert (small.kv_heads, small.q_heads, small.tp_sizes()) == (4, 8, [1, 2, 4])
    for good in (1, 2, 4):
        plan.NodePlan(busy_tp=good).check_busy_tp(small)
    for bad in (3, 8):
        with pytest.raises(ValueError, match=rf"--busy-tp {bad}: .* 4 KV heads .* \[1, 2, 4\]"):
            plan.NodePlan(busy_tp=bad).check_busy_tp(small)


def test_main_refuses_the_tp_before_starting_any_server(monkeypatch, tmp_path):
    """bench_node.py --busy-tp 3 exits with the error before a server starts (run_node would
    fail this test)."""
    dirs = {}
    for shape, cfg in (("small", SMALL), ("tiny", TINY)):
        dirs[shape] = tmp_path / shape
        dirs[shape].mkdir()
        (dirs[shape] / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(cli, "ensure_tiny_model", lambda shape: dirs[shape])
    monkeypatch.setattr(cli, "run_node", lambda *a, **k: pytest.fail("a server was started"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["--quick", "--busy-tp", "3", "--out", str(tmp_path / "out")])
    assert "--busy-tp 3" in str(stop.value.code) and "[1, 2, 4]" in str(stop.value.code)
