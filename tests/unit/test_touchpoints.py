"""The manifest of SwiftCache's touch points on SGLang (`integration/touchpoints.py`).

Invariants: every entry passes its checks on the installed (pinned) SGLang; every entry states
the SGLang releases it holds for, the pinned one among those it was verified on, and an SGLang
outside that range is reported; a changed SGLang is reported per entry (a missing target, a
private name gone from the source that sets it, a changed signature or behaviour); the CPU
stand-ins are checked only where the CPU compatibility layer is active; each private name or
re-implementation listed is in the product module that touches it; and no product module
outside the manifest spells an SGLang hook target (`sglang.srt.<...>.<Class>.<method>`) except
the CPU stand-ins' modules, whose lists the manifest imports."""

from __future__ import annotations

import ast
from pathlib import Path

from sglang_swift.integration import touchpoints as tp

ROOT = Path(__file__).resolve().parents[2]


def test_every_touch_point_holds_on_the_installed_sglang():
    assert tp.problems() == []
    assert len({p.target for p in tp.ALL}) == len(tp.ALL)


def test_every_entry_states_the_versions_it_was_verified_on():
    from sglang_swift.integration.plugin import PINNED_SGLANG

    for point in tp.ALL:
        v = point.versions
        assert v is not None and v.verified, point.target
        assert PINNED_SGLANG in v and PINNED_SGLANG in v.verified, point.target
        assert all(release in v for release in v.verified), point.target
        assert tp.version_key(v.low) <= tp.version_key(v.high), point.target


def test_an_sglang_outside_an_entrys_range_is_reported():
    ranged = tp.TouchPoint(tp.ADD_CLI_ARGS.target, tp.Kind.AFTER, "", "", "",
                           versions=tp.Versions("0.5.20", "0.5.23", ("0.5.23",)))
    assert tp.problems((ranged,), version="0.5.23") == []
    assert tp.problems((ranged,), version="0.5.23.post1") == []
    found = tp.problems((ranged,), version="0.6.0")
    assert len(found) == 1 and "0.5.20 to 0.5.23" in found[0] and "not 0.6.0" in found[0]
    assert len(tp.problems((ranged,), version="0.5.19")) == 1


def test_cpu_stand_ins_are_checked_only_where_the_cpu_layer_is_active():
    gone = tp.TouchPoint("sglang.srt.server_args.ServerArgs.no_such_stand_in", tp.Kind.BEFORE,
                         "", "", "", versions=tp.SGLANG_0_5_23, cpu_only=True)
    assert tp.problems((gone,), environ={"SWIFTCACHE_CPU_COMPAT": "1"}) != []
    assert tp.problems((gone,), environ={"SWIFTCACHE_CPU_COMPAT": "0"}) == []
    stand_ins = [p for p in tp.ALL if p.cpu_only]
    assert set(tp.HICACHE_STAND_INS) <= set(stand_ins) and tp.CPU_DEFAULTS in stand_ins


def test_a_behaviour_check_reports_what_differs():
    def differs(obj):
        return "it differs"

    def raises(obj):
        raise RuntimeError("boom")

    points = tuple(tp.TouchPoint(f"argparse.ArgumentParser.{name}", tp.Kind.SIGNATURE, "", "",
                                 "", (tp.Check(tp.How.BEHAVES, behaves=run),))
                   for name, run in (("parse_args", differs), ("add_argument", raises)))
    found = tp.problems(points)
    assert len(found) == 2 and "it differs" in found[0] and "raised RuntimeError" in found[1]


def test_a_changed_sglang_is_reported_per_entry():
    gone = tp.TouchPoint("sglang.srt.server_args.ServerArgs.no_such_hook", tp.Kind.AFTER,
                         "", "", "")
    renamed = tp.TouchPoint(
        "sglang.srt.server_args.ServerArgs._renamed", tp.Kind.PRIVATE_READ, "", "", "",
        (tp.Check(tp.How.SOURCE, "sglang.srt.server_args.ServerArgs.resolve_once",
                  ("_renamed",)),))
    moved = tp.TouchPoint(
        "sglang.srt.managers.scheduler.Scheduler.run_batch.batch", tp.Kind.SIGNATURE, "", "", "",
        (tp.Check(tp.How.LEADING_PARAMS, "sglang.srt.managers.scheduler.Scheduler.run_batch",
                  ("self", "pp_proxy_tensors")),))
    found = tp.problems((gone, renamed, moved, tp.ADD_CLI_ARGS))
    assert len(found) == 3
    assert "no_such_hook not found" in found[0]
    assert "no longer mentions _renamed" in found[1]
    assert "takes self, batch first" in found[2]


def _module_source(dotted: str) -> str:
    path = ROOT / Path(*dotted.split("."))
    return (path.with_suffix(".py") if path.with_suffix(".py").exists()
            else path / "__init__.py").read_text()


def test_each_listed_touch_is_where_the_manifest_says():
    """A private name read or written, a class swap, a re-implementation: the module named in
    `used_in` has it (a stale entry, or one naming the wrong module, fails here)."""
    words = {tp.Kind.PRIVATE_READ: lambda p: p.mark or p.attr,
             tp.Kind.PRIVATE_WRITE: lambda p: p.mark or p.attr,
             tp.Kind.PRIVATE_CALL: lambda p: p.mark or p.attr,
             tp.Kind.CLASS_SWAP: lambda p: "__class__ =",
             tp.Kind.REIMPLEMENTATION: lambda p: p.mark}
    for point in tp.ALL:
        if point.kind in words and point not in tp.HICACHE_STAND_INS:  # checked below
            word = words[point.kind](point)
            assert word and word in _module_source(point.used_in), point.target


def _string_constants(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def test_no_hook_target_is_spelled_outside_the_manifest():
    manifest = ROOT / "sglang_swift" / "integration" / "touchpoints.py"
    stand_ins = [ROOT / "sglang_swift" / "cpu_compat" / f"{name}.py"
                 for name in ("server_defaults", "hicache")]
    spelled = []
    for path in sorted((ROOT / "sglang_swift").rglob("*.py")):
        if path in (manifest, *stand_ins):
            continue
        for text in _string_constants(path):
            parts = text.split(".")
            if text.startswith("sglang.srt.") and " " not in text and len(parts) > 3 \
                    and any(p[:1].isupper() for p in parts):
                spelled.append(f"{path.relative_to(ROOT)}: {text}")
    assert spelled == []


def test_the_hicache_stand_ins_are_in_the_manifest():
    """Every patch cpu_compat/hicache.py installs is an entry, with a kind the manifest knows."""
    from sglang_swift.cpu_compat import hicache

    listed = {p.target: p for p in tp.ALL}
    for patch in hicache.PATCHES:
        point = listed[patch.dotted]
        assert point.kind.value == patch.kind and point.used_in == hicache.USED_IN
