#!/usr/bin/env python3
"""Run a benchmark and keep its result as a record under docs/records/ (pages render from these).

    python scripts/record_run.py NAME -- python scripts/bench_node.py --quick

The benchmark's last output line must be a JSON object (every benchmark under scripts/ ends so).
The record holds that object with the command, its start time (UTC), the commit and whether the
tree had uncommitted changes when the command started (outside docs/records/ and docs/img/, where
records and benchmark plots are written), the machine, the load average before and after, and the
wall time;
the benchmark's whole output goes beside it as NAME.log. `scripts/render_results.py` turns the
records into docs/results.md and the README's results table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "records"
# what runs write into the tree, and the pages rendered from it (refresh_records.sh renders)
OUTPUTS = ("docs/records", "docs/img", "README.md", "docs/results.md")
PRODUCT = ("sglang_swift", "radix_ext", "swift_kernels", "pyproject.toml")  # what users install


def git(*args: str, root: Path = ROOT, env: dict | None = None) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, env=env)
    return out.stdout.strip() if out.returncode == 0 else ""


def _tree_of_worktree(root: Path) -> str:
    """A git tree of the working tree as it stands (tracked and untracked files git does not
    ignore), written through a private copy of the index so the shared one is left alone."""
    index = git("rev-parse", "--path-format=absolute", "--git-path", "index", root=root)
    if not index:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        if Path(index).exists():
            shutil.copy(index, env["GIT_INDEX_FILE"])  # its stat cache spares rehashing
        present = [p for p in PRODUCT if (root / p).exists()]  # a missing path fails `add`
        gone = [p for p in PRODUCT if p not in present]
        if present:
            git("add", "-A", "--", *present, root=root, env=env)
        if gone:
            git("rm", "-r", "-q", "--cached", "--ignore-unmatch", "--", *gone, root=root, env=env)
        return git("write-tree", root=root, env=env)


def product_tree(commit: str | None = None, root: Path = ROOT) -> str | None:
    """The product's identity: a hash over the git object ids of PRODUCT in `commit` (None: the
    working tree now). Two runs share it exactly when sglang_swift, radix_ext, swift_kernels and
    pyproject.toml are identical. None where git cannot tell (no repository, unknown commit)."""
    tree = _tree_of_worktree(root) if commit is None else commit
    listing = git("ls-tree", tree, "--", *PRODUCT, root=root) if tree else ""
    if not listing:
        return None
    entries = sorted(line.split("\t", 1)[::-1] for line in listing.splitlines())  # path, meta
    text = "".join(f"{path} {meta.split()[2]}\n" for path, meta in entries)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def last_json_line(text: str) -> dict:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            return json.loads(line)
    raise ValueError("the command printed no JSON object on a line of its own")


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", help="record name: docs/records/NAME.json (letters, digits, _ and -)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given (put it after --)")
    if not args.name.replace("_", "").replace("-", "").isalnum():
        ap.error(f"record name {args.name!r}: use letters, digits, _ and - only")
    RECORDS.mkdir(parents=True, exist_ok=True)
    # the tree the command ran from, read before it runs; records and plots written by this or an
    # earlier run are outputs, not changes to what ran
    uncommitted = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".",
                           *(f":(exclude){p}" for p in OUTPUTS)))
    product = product_tree(root=ROOT)
    started = dt.datetime.now(dt.timezone.utc)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    wall = time.monotonic() - t0
    (RECORDS / f"{args.name}.log").write_text(proc.stdout)
    if proc.returncode != 0:
        print(proc.stdout[-4000:], file=sys.stderr)
        print(f"record_run: {shlex.join(cmd)} exited {proc.returncode}; no record written",
              file=sys.stderr)
        return proc.returncode
    record = {
        "name": args.name,
        "command": shlex.join(cmd),
        "started_utc": started.strftime("%Y-%m-%d %H:%M"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": uncommitted,
        "product_tree": product,
        "product_uncommitted": product != product_tree("HEAD"),
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(wall, 1),
        "result": last_json_line(proc.stdout),
    }
    path = RECORDS / f"{args.name}.json"
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"record_run: {shown} ({wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
