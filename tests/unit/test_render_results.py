"""docs/results.md and the README's generated tables match the records in docs/records/."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_results",
                                                  ROOT / "scripts" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("render_results", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _record_run():
    spec = importlib.util.spec_from_file_location("record_run",
                                                  ROOT / "scripts" / "record_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_pages(tmp: Path) -> Path:
    (tmp / "docs" / "records").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", tmp / "README.md")
    shutil.copy(ROOT / "docs" / "results.template.md", tmp / "docs" / "results.template.md")
    shutil.copy(ROOT / "docs" / "results.md", tmp / "docs" / "results.md")
    for rec in (ROOT / "docs" / "records").glob("*.json"):
        shutil.copy(rec, tmp / "docs" / "records" / rec.name)
    return tmp


def test_pages_are_rendered_from_the_records():
    """Invariant: no figure on the pages was edited by hand (--check passes on the repository,
    each record marked against the committed product; on a clean clone that is the working
    tree's)."""
    assert _renderer().main(["--check", "--against", "HEAD"]) == 0


def test_a_hand_edited_figure_fails_the_check(tmp_path):
    """Invariant: --check fails when a page differs from what the records render."""
    r = _renderer()
    root = _copy_pages(tmp_path)
    page = root / "docs" / "results.md"
    page.write_text(page.read_text().replace("## Headline figures", "## Headline figures (x)"))
    assert r.main(["--check"], root=root) == 1
    assert r.main([], root=root) == 0 and r.main(["--check"], root=root) == 0


def test_a_new_record_changes_the_pages_and_a_missing_one_says_so(tmp_path):
    """Invariant: a record's figures reach both pages with its citation; a missing record renders
    as 'not yet recorded' instead of failing."""
    r = _renderer()
    root = _copy_pages(tmp_path)
    for rec in (root / "docs" / "records").glob("*.json"):
        rec.unlink()
    assert r.main([], root=root) == 0
    assert r.NOT_RECORDED in (root / "README.md").read_text()
    record = {"name": "demo", "command": "bash scripts/demo.sh", "started_utc": "2030-01-02 03:04",
              "commit": "abc1234", "uncommitted_changes": False, "machine": {"cpus": 2},
              "load_average_before": [0.5, 0.4, 0.3], "load_average_after": [1.5, 1.0, 0.5],
              "wall_s": 120.0, "result": {"conversations": 6, "turns": 6,
                                          "identical_outputs": 27, "requests": 27,
                                          "cached_tokens": [3598, 792], "cached_ratio": 4.543}}
    (root / "docs" / "records" / "demo.json").write_text(json.dumps(record))
    assert r.main(["--check"], root=root) == 1
    assert r.main([], root=root) == 0
    readme, results = (root / "README.md").read_text(), (root / "docs" / "results.md").read_text()
    assert "`27/27`" in readme and "`4.543`" in readme
    assert "commit abc1234" in results and "`bash scripts/demo.sh`" in results
    assert "2030-01-02" in results


def _demo_record(**extra) -> dict:
    return {"name": "demo", "command": "bash scripts/demo.sh", "started_utc": "2030-01-02 03:04",
            "commit": "abc1234", "uncommitted_changes": False, "machine": {"cpus": 2},
            "load_average_before": [0.5, 0.4, 0.3], "load_average_after": [1.5, 1.0, 0.5],
            "wall_s": 120.0, "result": {"identical_outputs": 27, "requests": 27,
                                        "cached_ratio": 4.543}, **extra}


def _readme_row(readme: str, label: str) -> str:
    block = readme.split("<!-- results:begin -->")[1].split("<!-- results:end -->")[0]
    return next(line for line in block.splitlines() if line.startswith(f"| {label} |"))


def test_a_record_of_older_product_code_is_marked_stale_beside_its_figures(tmp_path, monkeypatch):
    """Invariant: a figure whose record ran on another product tree than the one now carries
    **stale** on both pages, one that ran on this tree `current`; --fail-stale exits 2 only
    while a record is not current."""
    r = _renderer()
    root = _copy_pages(tmp_path)
    for rec in (root / "docs" / "records").glob("*.json"):
        rec.unlink()
    path = root / "docs" / "records" / "demo.json"
    path.write_text(json.dumps(_demo_record(product_tree="aaaaaaaaaaaa")))
    monkeypatch.setattr(r, "product_now", lambda root, against=None: "bbbbbbbbbbbb")
    assert r.main([], root=root) == 0
    readme, results = (root / "README.md").read_text(), (root / "docs" / "results.md").read_text()
    assert _readme_row(readme, "outputs identical to stock SGLang").endswith("| **stale** |")
    assert "product tree aaaaaaaaaaaa: **stale**" in results
    assert r.main(["--check"], root=root) == 0
    assert r.main(["--check", "--fail-stale"], root=root) == 2
    path.write_text(json.dumps(_demo_record(product_tree="bbbbbbbbbbbb")))
    assert r.main(["--check"], root=root) == 1  # the mark changed: the pages are out of date
    assert r.main([], root=root) == 0
    readme = (root / "README.md").read_text()
    assert _readme_row(readme, "outputs identical to stock SGLang").endswith("| current |")
    assert r.main(["--check", "--fail-stale"], root=root) == 0


def test_a_record_from_an_uncommitted_tree_says_so_and_is_never_provably_current():
    """Invariant: a command that ran on an uncommitted tree shows it; without the product tree
    taken from that tree, the commit's tree does not make it current."""
    r = _renderer()
    derived = r.Freshness("aaa", "aaa", uncommitted=True, exact=False)
    assert derived.mark() == "current, uncommitted tree" and not derived.current
    exact = r.Freshness("aaa", "aaa", uncommitted=True, exact=True)
    assert exact.current
    assert r.Freshness("aaa", "bbb", uncommitted=False, exact=False).mark() == "**stale**"
    assert r.Freshness(None, "bbb", uncommitted=False, exact=False).mark() == "unknown"


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def test_the_product_tree_changes_with_product_code_only(tmp_path):
    """Invariant: the product tree of the working tree is that of HEAD until a product file
    changes (committed or not, untracked included); other files do not change it."""
    if shutil.which("git") is None:
        pytest.skip("no git")
    rr = _record_run()
    repo = tmp_path
    _git(repo, "init", "-q")
    for rel in ("sglang_swift/a.py", "radix_ext/b.py", "swift_kernels/c.py", "pyproject.toml",
                "scripts/d.py"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(rel + "\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "x")
    head = rr.product_tree("HEAD", repo)
    assert head and rr.product_tree(None, repo) == head
    (repo / "scripts" / "d.py").write_text("changed\n")
    assert rr.product_tree(None, repo) == head
    (repo / "radix_ext" / "new.py").write_text("untracked\n")
    assert rr.product_tree(None, repo) != head
    assert "?? radix_ext/new.py" in _git(repo, "status", "--porcelain")  # index left alone
    (repo / "radix_ext" / "new.py").unlink()
    (repo / "sglang_swift" / "a.py").write_text("edited\n")
    edited = rr.product_tree(None, repo)
    assert edited != head
    _git(repo, "commit", "-q", "-am", "y")
    assert rr.product_tree("HEAD", repo) == edited and rr.product_tree("HEAD~1", repo) == head
    shutil.rmtree(repo / "swift_kernels")  # a product path gone from the working tree
    assert rr.product_tree(None, repo) not in (None, edited)


def test_the_refresh_plan_lists_what_fits_this_machine(tmp_path):
    """Invariant: refresh_records.sh re-runs each record with its recorded command; --stale-only
    leaves current records out, records that ran on more CPUs than here are left out, and
    --dry-run only prints the plan."""
    r = _renderer()
    big = {**_demo_record(product_tree="now"), "name": "chaos_quick",
           "command": "python scripts/chaos.py --quick", "machine": {"cpus": 64}}
    records = {"demo": {**_demo_record(command="bash -c 'echo a && echo b'"),
                        "_freshness": r.Freshness("old", "now", False, True)},
               "chaos_quick": {**big, "_freshness": r.Freshness("now", "now", False, True)},
               "bench_tree_quick": {**_demo_record(name="bench_tree_quick"),
                                    "_freshness": r.Freshness("now", "now", False, True)}}
    plan = dict(r.refresh_plan(records, cpus=2))
    assert plan["demo"] == ["bash", "-c", "echo a && echo b"]
    assert "chaos_quick" not in plan and "bench_tree_quick" in plan
    assert set(plan) <= set(r.RECORDS) and len(plan) == len(r.RECORDS) - 1  # missing: spec's
    assert plan["bench_node_quick"][:2] == [".venv/bin/python", "scripts/bench_node.py"]
    stale = dict(r.refresh_plan(records, stale_only=True, cpus=2))
    assert "demo" in stale and "bench_tree_quick" not in stale
    out = subprocess.run(["bash", str(ROOT / "scripts" / "refresh_records.sh"), "--dry-run",
                          "demo", "bench_tree_quick"], capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert [line.split("\t")[0] for line in out] == ["demo", "bench_tree_quick"]
    records_dir = ROOT / "docs" / "records"
    assert out[0].split("\t")[1] == json.loads((records_dir / "demo.json").read_text())["command"]


def test_the_readme_reads_in_a_minute():
    """Invariant: README.md is at most 200 lines, its results block at most 20, and no line
    outside code blocks and tables is over 100 characters."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200
    block = text.split("<!-- results:begin -->")[1].split("<!-- results:end -->")[0]
    assert len(block.strip().splitlines()) <= 20
    in_code = False
    for n, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and not line.startswith("|"):
            assert len(line) <= 100, (n, line)


def test_every_key_of_the_existing_records_is_described():
    """Invariant: docs/results.md defines every key a checked-in record holds."""
    r = _renderer()
    for path in (ROOT / "docs" / "records").glob("*.json"):
        result = json.loads(path.read_text())["result"]
        described = {k.split(".")[0] for k in r.RECORDS[path.stem].keys}
        assert set(result) <= described, (path.name, set(result) - described)


def test_the_options_table_lists_every_cli_option():
    """Invariant: the README's options table is SwiftConfig's cli_options(), one row each."""
    from sglang_swift.config import cli_options

    readme = (ROOT / "README.md").read_text()
    table = readme.split("<!-- options:begin -->")[1].split("<!-- options:end -->")[0]
    for flag, _ in cli_options():
        assert f"| `{flag}` |" in table


def test_a_new_record_carries_the_product_tree_it_ran_on(tmp_path, monkeypatch):
    """Invariant: record_run.py stores the working tree's product tree and whether the product
    differed from HEAD's, so the pages can tell a record of older product code."""
    rr = _record_run()
    monkeypatch.setattr(rr, "RECORDS", tmp_path)
    cmd = [sys.executable, "-c", "print('{\"x\": 1}')"]
    assert rr.main(["probe", "--", *cmd]) == 0
    rec = json.loads((tmp_path / "probe.json").read_text())
    assert rec["result"] == {"x": 1}
    assert rec["product_tree"] == rr.product_tree() and len(rec["product_tree"]) == 12
    assert rec["product_uncommitted"] == (rr.product_tree() != rr.product_tree("HEAD"))


def _rec(name: str, result: dict) -> dict:
    return {"name": name, "command": f"python {name}", "started_utc": "2030-01-02 03:04",
            "commit": "abc1234", "uncommitted_changes": False, "machine": {"cpus": 2},
            "load_average_before": [0.5, 0.4, 0.3], "load_average_after": [1.5, 1.0, 0.5],
            "wall_s": 1.0, "result": result}


UPPER_TIERS = {"identical": True, "cached_vs_hicache": 2.0, "cached_vs_upper_bound": 0.875,
               "hicache_cached_vs_upper_bound": 0.4, "ttft_p50_vs_upper_bound": 1.25,
               "ttft_p99_vs_upper_bound": 1.5, "ttft_p99_upper_bound_vs_hicache": 0.75,
               "upper_bound_pool_tokens": 1665, "upper_bound_exceeded": None,
               "empty_in_both": {"h": 1, "s": 1, "u": 0, "t": 1}}
IDEAL_TIERS = {"identical": True, "cached_vs_hicache": 2.0, "cached_vs_ideal": 1.11,
               "ttft_p99_ideal_vs_hicache": 1.117}
UPPER_LOOP = {"identical": True, "cached_vs_upper_bound": 0.9375,
              "closed_loop_ttft_avg_vs_upper_bound": 1.05,
              "closed_loop_ttft_p90_vs_upper_bound": 1.1,
              "closed_loop_ttft_p99_vs_upper_bound": 1.125, "closed_loop_ttft_avg_noise": 1.025,
              "closed_loop_ttft_p99_noise": 1.05, "stock_ttft_avg_vs_upper_bound": 1.3,
              "stock_ttft_p99_vs_upper_bound": 1.4, "upper_bound_pool": 1536,
              "unlimited_cache_tokens": 2000, "cached_vs_unlimited_cache": 0.9,
              "upper_bound_exceeded": None}
IDEAL_LOOP = {"identical": True, "cached_vs_ideal": 1.0, "closed_loop_ttft_avg_vs_ideal": 0.9868,
              "closed_loop_ttft_p99_vs_ideal": 1.005, "closed_loop_ttft_avg_noise": 1.114,
              "closed_loop_ttft_p99_noise": 1.074}


def _pages(r, tiers: dict, loop: dict) -> str:
    records = {"bench_tiers_quick": _rec("bench_tiers_quick", tiers),
               "bench_node_closed_loop": _rec("bench_node_closed_loop", loop)}
    return "\n".join([*r.headline_rows(records, ""), *r.summary_rows(records, ""),
                      *r.comparison_rows(records, ""),
                      r.record_section("bench_tiers_quick", records),
                      r.record_section("bench_node_closed_loop", records)])


def test_a_record_with_the_upper_bound_renders_it_by_name():
    """Invariant: the new keys render under labels that say what the bound is (one stock pool
    of device + lent + host), each described, and no figure of such a record is labelled as
    the older ideal run."""
    r = _renderer()
    page = _pages(r, UPPER_TIERS, UPPER_LOOP)
    ub = "upper bound (one stock pool of device + lent + host)"
    assert f"| cached tokens (s) / {ub} | `0.875` |" in page
    assert f"| cached tokens / {ub} | `0.9375` |" in page
    assert "| TTFT P99 / upper bound | `1.125` |" in page
    assert "| upper bound twin / upper bound, mean TTFT (noise floor) | `1.025` |" in page
    assert "closed loop, cached tokens, SwiftCache / upper bound: `0.9375`" in page
    for k in UPPER_TIERS:
        assert f"| `{k}` |" in page, k
    assert "(not described)" not in page
    assert "older ideal" not in page.split("against the ideal")[0]  # headlines, summaries
    assert "| older ideal run's twin" not in page


def test_an_older_record_keeps_its_ideal_figures_never_called_an_upper_bound():
    """Invariant: a record made with the older ideal run shows its figures labelled as that
    older baseline (for bench_tiers: not an upper bound); no headline or comparison figure of
    it is labelled as the upper bound, and the upper bound's row says it is not yet recorded."""
    r = _renderer()
    page = _pages(r, IDEAL_TIERS, IDEAL_LOOP)
    assert ("| cached tokens (s) / older ideal baseline (i) (HiCache with the lent memory as "
            "device memory, not an upper bound) | `1.11` |") in page
    assert "| cached tokens / older ideal run (stock SGLang with the lent memory added to its " \
           "device pool) | `1.0` |" in page
    assert "| older ideal run's twin / it, mean TTFT (noise floor) | `1.114` |" in page
    headlines = page.split("| claim |")[0]
    assert "/ upper bound" not in headlines and "upper bound twin" not in headlines
    bound_row = next(line for line in page.splitlines() if line.startswith("| against an upper"))
    assert bound_row.endswith(f"| {r.NOT_RECORDED} | none ran |")
    assert "(not described)" not in page


def test_the_readme_calls_nothing_an_upper_bound_that_was_not_one():
    """Invariant: no README figure reads a key of the older ideal run, and any README figure
    named an upper bound reads an upper-bound key."""
    r = _renderer()
    for _, f in r.README_FIGURES:
        probe = {**IDEAL_TIERS, **IDEAL_LOOP}
        assert "upper bound" not in f.label or f.read(probe) is None, f.label
        assert "ideal" not in f.label.lower(), f.label


def test_depth0_is_compared_with_the_twin_seed_by_seed():
    r = _renderer()
    point = {"mapped_ttft_p99_vs_ideal": {"per_seed": [1.2, 1.0, 0.9]},
             "twin_ttft_p99_vs_ideal": {"per_seed": [1.5, 1.0, 0.6]},
             "mapped_ttft_avg_vs_ideal": {"mean": 1.0},  # an older record: no seed's ratio
             "twin_ttft_avg_vs_ideal": {"mean": 1.0}}
    out = r._depth0_vs_twin({"16": point})
    p99 = out["16_depth0_vs_twin"]["ttft_p99"]
    assert p99["per_seed"] == pytest.approx([0.8, 1.0, 1.5])
    assert p99["mean"] == pytest.approx(3.3 / 3) and p99["seeds_at_most_twin"] == 2
    assert "ttft_avg" not in out["16_depth0_vs_twin"] and "8_depth0_vs_twin" not in out
    spec = r.RECORDS["bench_multiturn_more_seeds"]
    assert spec.headlines[1].read(r._depth0_vs_twin({"16": point})) == 2


def _ratio(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "worst": max(values),
            "spread": max(values) - min(values)}


def _multiturn_point(seeds: int, **ratios: list[float]) -> dict:
    return {"seeds": seeds, **{k: _ratio(v) for k, v in ratios.items()}}


def test_the_multiturn_targets_pool_every_seed_of_one_product():
    """Pooled from summaries only (mean, worst, spread per run), the figures equal those of the
    seeds taken together; the twin is pooled over the same runs as the server; a run of another
    product is left out; each target that fails is named, and none when all hold."""
    r = _renderer()
    a = [1.00, 1.30, 0.95]  # seeds 1-3 of the full record
    b = [1.05, 0.90, 1.00, 1.10, 0.98, 1.02]  # six more seeds
    pooled = r.pooled([{**_ratio(a), "seeds": 3}, {**_ratio(b), "seeds": 6}])
    assert pooled["mean"] == pytest.approx(sum(a + b) / 9)
    assert pooled["worst"] == 1.30 and pooled["spread"] == pytest.approx(1.30 - 0.90)
    assert pooled["seeds"] == 9 and r.pooled([]) is None

    full = {"16": {**_multiturn_point(3, mapped_ttft_p99_vs_stock=[0.3, 0.2, 0.25],
                                      mapped_ttft_avg_vs_ideal=a,
                                      mapped_ttft_p99_vs_ideal=[1.0, 1.4, 1.3],
                                      twin_ttft_avg_vs_ideal=[1.0, 1.01, 1.02],
                                      twin_ttft_p99_vs_ideal=[1.0, 1.9, 1.1]),
                   **_multiturn_point(3, ttft_p99_vs_stock=[0.9, 1.1, 1.0],
                                      ttft_avg_vs_ideal=[1.0, 1.05, 1.1],
                                      ttft_p99_vs_ideal=[1.0, 1.1, 1.2])}}
    more = {"16": _multiturn_point(6, mapped_ttft_p99_vs_stock=[0.2] * 6,
                                   mapped_ttft_avg_vs_ideal=b,
                                   mapped_ttft_p99_vs_ideal=[1.0, 0.9, 1.1, 1.0, 1.0, 1.0],
                                   twin_ttft_avg_vs_ideal=[0.75, 1.2, 1.0, 1.0, 1.0, 1.0],
                                   twin_ttft_p99_vs_ideal=[0.7, 1.0, 1.0, 1.0, 1.0, 1.0])}
    other = {"16": _multiturn_point(6, mapped_ttft_p99_vs_stock=[5.0] * 6,
                                    mapped_ttft_avg_vs_ideal=[9.0] * 6,
                                    mapped_ttft_p99_vs_ideal=[9.0] * 6,
                                    twin_ttft_avg_vs_ideal=[1.0] * 6,
                                    twin_ttft_p99_vs_ideal=[1.0] * 6)}
    records = {"bench_multiturn": {"product_tree": "p", "result": full},
               "bench_multiturn_more_seeds": {"product_tree": "p", "result": more},
               "bench_multiturn_more_seeds_8": {"product_tree": "q", "result": other}}
    verdict = r.multiturn_targets(records)
    depth0 = verdict[("16", "read in place (depth 0, CPU only)")]
    assert depth0["seeds"] == 9 and depth0["missed"] == []
    assert depth0["ttft_avg_vs_ideal"]["mean"] == pytest.approx(sum(a + b) / 9)
    assert depth0["twin_avg"]["spread"] == pytest.approx(0.45)  # 0.75-1.2: both runs
    tier = verdict[("16", "donor tier")]  # seeds 1-3 only: its twin over those three
    assert tier["seeds"] == 3 and tier["twin_avg"]["spread"] == pytest.approx(0.02)
    assert tier["missed"] == ["P99 above stock's in a run",
                              "mean TTFT's spread wider than the twin's"]
    records["bench_multiturn_more_seeds"]["product_tree"] = "q"  # another product: not pooled
    alone = r.multiturn_targets(records)[("16", "read in place (depth 0, CPU only)")]
    assert alone["seeds"] == 3 and "P99 above 1.20x the ideal's" in alone["missed"]
    rows = r.multiturn_target_rows(records)
    assert any(row.startswith("| 16 | donor tier | 3 | 1.10 |") for row in rows)
    assert r.multiturn_target_rows({}) == [f"*{r.NOT_RECORDED}.*"]
