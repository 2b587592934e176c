"""docs/results.md and the README's generated tables match the records in docs/records/."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _renderer():
    spec = importlib.util.spec_from_file_location("render_results",
                                                  ROOT / "scripts" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("render_results", module)  # dataclasses look their module up there
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
    """Invariant: no figure on the pages was edited by hand (--check passes on the repository)."""
    assert _renderer().main(["--check"]) == 0


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
    assert "`27/27`" in readme and "`4.543`" in readme and "2030-01-02" in readme
    assert "commit abc1234" in results and "`bash scripts/demo.sh`" in results


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
