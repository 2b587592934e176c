"""Unit tests for radix_ext's tree operations, one contract each."""

from __future__ import annotations

import copy
from array import array

import pytest

from radix_ext import DEVICE, DONOR, HOST, RadixTree, TreeConfig, settle


def evict(t: RadixTree, n: int):
    """`evict_device`, then every store completes at once (as if each copy ran)."""
    plan = t.evict_device(n)
    settle(t, plan.stores, [True] * len(plan.stores))
    return plan


def test_import_needs_neither_torch_nor_sglang():
    import subprocess
    import sys

    code = ("import sys, radix_ext; bad = [m for m in ('torch', 'sglang', 'triton') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_match_is_page_aligned_and_splits_inside_a_node():
    t = RadixTree(TreeConfig(page_size=2))
    t.insert([1, 2, 3, 4, 5, 6], range(6))
    m = t.match([1, 2, 3, 9])
    assert (m.prefix_len, m.device_len) == (2, 2)
    assert list(t.device_indices(m.last_device_node)) == [0, 1]
    assert t.match([1, 2, 3, 4, 5]).prefix_len == 4  # the odd token never matches
    t.check_integrity()


def test_namespaces_never_share_nodes():
    t = RadixTree()
    t.insert([1, 2, 3], [0, 1, 2], namespace="lora-a")
    assert t.match([1, 2, 3]).prefix_len == 0
    assert t.match([1, 2, 3], "lora-b").prefix_len == 0
    assert t.match([1, 2, 3], "lora-a").prefix_len == 3


def test_insert_reports_the_duplicates_the_caller_frees():
    t = RadixTree()
    t.insert([1, 2, 3], [0, 1, 2])
    r = t.insert([1, 2, 3, 4, 5], [7, 8, 9, 3, 4])
    assert (r.prefix_len, r.duplicate_len) == (3, 3)  # caller frees 7, 8, 9
    assert list(t.device_indices(r.last_node)) == [0, 1, 2, 3, 4]
    assert t.device_size() == 5
    t.check_integrity()


def test_insert_over_a_lower_tier_copy_adopts_the_callers_slots():
    t = RadixTree(TreeConfig(donor=True))
    t.donor.add_lease("d", 0, 1, 8)
    t.insert([1, 2], [0, 1])
    evict(t, 2)
    r = t.insert([1, 2, 3], [5, 6, 7])
    assert (r.prefix_len, r.duplicate_len) == (2, 0)  # nothing to free: all slots adopted
    node = t.match([1, 2]).last_device_node
    assert set(node.res) == {DEVICE, DONOR}  # write-through copy kept
    t.check_integrity()


def test_unbalanced_unlock_and_locking_a_non_device_node_fail():
    t = RadixTree(TreeConfig(donor=True))
    t.donor.add_lease("d", 0, 1, 8)
    node = t.insert([1, 2], [0, 1]).last_node
    with pytest.raises(ValueError):
        t.unlock(node)
    evict(t, 2)
    with pytest.raises(ValueError):
        t.lock(node)


def snapshot(t: RadixTree):
    def walk(x):
        return (list(x.key), sorted(x.res), x.lock_ref, x.pins,
                sorted((k if not isinstance(k, tuple) else str(k), walk(c))
                       for k, c in x.children.items()))

    return walk(t.root), t.evictable_size(), t.protected_size(), t.tier_size(DONOR)


def _tree_with_donor_copies() -> RadixTree:
    t = RadixTree(TreeConfig(donor=True))
    t.donor.add_lease("d", 0, 1, 8)
    t.insert([1, 2, 3, 4], [0, 1, 2, 3])
    t.insert([1, 2, 5], [9, 9, 4])
    evict(t, 3)
    return t


def test_a_load_in_flight_is_neither_repeated_nor_undercut():
    t = _tree_with_donor_copies()
    m = t.match([1, 2, 3, 4])
    ticket = t.begin_load_back(m.last_node, list(range(10, 10 + m.load_len)))
    assert ticket is not None and [c.src_tier for c in ticket.copies] == [DONOR] * len(m.loads)
    assert t.begin_load_back(m.last_node, [0] * m.load_len) is None  # already in flight
    evict(t, 100)
    assert DEVICE in ticket.anchor.res, "the path being loaded onto was evicted"
    assert all(DONOR in s.node.res for s in m.loads), "a source being read was dropped"
    t.check_integrity()


def test_aborted_load_back_leaves_the_tree_exactly_as_before():
    t = _tree_with_donor_copies()
    m = t.match([1, 2, 3, 4])
    before = snapshot(t)
    ticket = t.begin_load_back(m.last_node, list(range(10, 10 + m.load_len)))
    out = t.abort_load_back(ticket)
    assert not out.ok and list(out.device_indices_to_free) == list(range(10, 10 + m.load_len))
    assert snapshot(t) == before
    t.check_integrity()


def test_completed_load_back_puts_the_path_on_the_device_under_the_callers_lock():
    t = RadixTree(TreeConfig(host_capacity=8))
    t.insert([1, 2, 3], [0, 1, 2])
    evict(t, 3)
    m = t.match([1, 2, 3])
    assert (m.device_len, m.tokens_from(HOST)) == (0, 3)
    out = t.complete_load_back(t.begin_load_back(m.last_node, [5, 6, 7]))
    assert out.ok and out.last_node.lock_ref == 1 and t.protected_size() == 3
    assert list(t.device_indices(out.last_node)) == [5, 6, 7]
    t.unlock(out.last_node)
    t.check_integrity()


def test_revoke_reports_lost_prefixes_and_fails_loads_in_flight():
    t = RadixTree(TreeConfig(donor=True, host_capacity=2))
    t.donor.add_lease("d", 0, 1, 8)
    t.insert([1, 2], [0, 1])
    t.insert([1, 2, 3, 4], [0, 1, 2, 3])
    t.insert([7, 7], [4, 5])
    evict(t, 6)  # all to donor except what fits on host
    m = t.match([1, 2, 3, 4])
    ticket = t.begin_load_back(m.last_node, list(range(10, 10 + m.load_len)))
    r = t.revoke("d")
    assert r.lost and all(t.match(lp.tokens, lp.namespace).prefix_len == lp.still_cached
                          for lp in r.lost)
    assert ticket.ticket_id in r.stale_tickets
    out = t.complete_load_back(ticket)
    assert not out.ok and len(out.device_indices_to_free) == m.load_len
    assert t.donor.leases == {} and t.tier_size(DONOR) == 0
    t.check_integrity()


def test_check_integrity_catches_drift():
    t = RadixTree()
    node = t.insert([1, 2], [0, 1]).last_node
    t.check_integrity()
    node.lock_ref += 1
    with pytest.raises(AssertionError):
        t.check_integrity()
    node.lock_ref -= 1
    t2 = copy.deepcopy(t)
    t2.insert([3], array("q", [0]))  # slot 0 owned twice
    with pytest.raises(AssertionError, match="owned twice"):
        t2.check_integrity()


def test_reset_returns_every_lower_tier_index():
    t = RadixTree(TreeConfig(donor=True, host_capacity=4))
    t.donor.add_lease("d", 0, 1, 4)
    t.insert([1, 2, 3, 4], [0, 1, 2, 3])
    t.insert([5, 6, 7, 8], [4, 5, 6, 7])
    evict(t, 8)
    assert t.tier_size(DONOR) + t.tier_size(HOST) == 8
    t.revoke("d", 0, [0])  # a lease with a hole in its block numbers
    t.reset()
    assert t.tier_size(DONOR) == 0 and t.tier_size(HOST) == 0 and t.match([1, 2]).prefix_len == 0
    t.check_integrity()


def test_revoking_blocks_a_lease_does_not_own_changes_nothing():
    t = RadixTree(TreeConfig(donor=True))
    t.donor.add_lease("d", 0, 1, 4)
    t.insert([1, 2], [0, 1])
    evict(t, 2)
    with pytest.raises(ValueError, match="not in lease"):
        t.revoke("d", 0, [99])
    assert t.match([1, 2]).prefix_len == 2
    t.check_integrity()
