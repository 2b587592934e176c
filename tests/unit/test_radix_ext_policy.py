"""Unit tests for the eviction and demotion strategies of radix_ext, one invariant each."""

from __future__ import annotations

import pytest

from radix_ext import DEVICE, DONOR, HOST, CostModel, RadixTree, TreeConfig


def tree(**kw) -> RadixTree:
    return RadixTree(TreeConfig(**kw))


def evict(t: RadixTree, n: int):
    """`evict_device`, then every store completes at once (as if each copy ran); the plan."""
    plan = t.evict_device(n)
    for ticket in plan.stores:
        assert t.complete_store(ticket).ok
    return plan


def fill(t: RadixTree, *keys):
    """Insert each key with fresh slots; returns the leaf node of each."""
    nodes, nxt = [], 0
    for k in keys:
        r = t.insert(k, range(nxt, nxt + len(k)))
        nxt += len(k)
        nodes.append(r.last_node)
    return nodes


# ---- LRU ----------------------------------------------------------------------------------------


def test_lru_evicts_least_recently_used_leaf_first():
    t = tree()
    a, b, c = fill(t, [1, 1], [2, 2], [3, 3])
    t.match([1, 1])  # a is now the most recent
    plan = evict(t, 2)
    assert [r.residency.indices.tolist() for r in plan.released] == [[2, 3]]  # b went
    assert DEVICE in a.res and DEVICE not in b.res and DEVICE in c.res
    t.check_integrity()


def test_lru_never_evicts_a_locked_path():
    t = tree()
    a, b = fill(t, [1, 1], [2, 2])
    t.lock(a)
    plan = evict(t, 10)
    assert plan.num_evicted == 2 and DEVICE in a.res
    t.unlock(a)
    assert evict(t, 10).num_evicted == 2
    t.check_integrity()


def test_tiered_demotes_to_donor_then_host_then_drops():
    t = tree(donor=True, host_capacity=2)
    t.donor.add_lease("d", 0, 1, 2)
    a, b, c = fill(t, [1, 1], [2, 2], [3, 3])
    where = [[s.dst_tier for s in evict(t, 2).copies] for _ in range(2)]
    assert where == [[DONOR], [HOST]], where
    plan = evict(t, 2)  # third: room made (the older copy goes), or dropped
    assert (plan.demoted, plan.dropped) == (0, 2) or [s.dst_tier for s in plan.copies] == [DONOR]
    t.check_integrity()


def test_tiered_makes_room_in_a_full_donor_rather_than_dropping():
    t = tree(donor=True)
    t.donor.add_lease("d", 0, 1, 2)
    fill(t, [1, 1], [2, 2])
    plan = evict(t, 4)
    # the older victim's store is cancelled to make room: its copy is never made, then dropped
    assert plan.dropped == 0 and [s.dst_tier for s in plan.copies] == [DONOR]
    assert t.match([2, 2]).prefix_len == 2 and t.match([1, 1]).prefix_len == 0
    t.check_integrity()


def test_lru_drops_a_donor_copy_of_a_device_prefix_before_an_older_donor_only_one():
    """A full donor tier makes room by dropping the copy of a node that is on the device (it
    loses nothing) before the least recently used copy of an evicted node (its only copy):
    a loaded-back prefix's recent donor duplicate must not push out older evicted prefixes."""
    t = tree(donor=True)
    t.donor.add_lease("d", 0, 1, 4)
    a, b, c = fill(t, [1, 1], [2, 2], [3, 3])
    evict(t, 4)  # a and b go to the donor, which is now full
    assert DONOR in a.res and DONOR in b.res and DEVICE not in a.res
    m = t.match([1, 1])
    t.unlock(t.complete_load_back(t.begin_load_back(m.last_node, [10, 11])).last_node)
    assert DEVICE in a.res and DONOR in a.res  # a is back, its donor copy is newer than b's
    t.match([3, 3])
    t.match([1, 1])  # c is now the least recently used device leaf
    plan = evict(t, 2)  # c needs donor room: a's duplicate goes, b's only copy stays
    assert [s.dst_tier for s in plan.copies] == [DONOR]
    assert DONOR in b.res and DONOR in c.res and DONOR not in a.res and DEVICE in a.res
    assert t.match([2, 2]).prefix_len == 2
    t.check_integrity()


def test_a_victim_no_single_lease_has_room_for_is_stored_after_room_is_made_in_one():
    """Two leases whose free blocks add up to more than a victim's size while neither holds it
    alone: the eviction makes room inside one lease (dropping its LRU copy) and stores the
    victim there, rather than dropping it because the tier as a whole looked roomy enough."""
    t = tree(donor=True)
    t.donor.add_lease("d", 0, 1, 5)
    t.donor.add_lease("d", 1, 1, 5)
    a, b, big = fill(t, [1, 1], [2, 2], [3, 3, 3, 3])
    evict(t, 2)
    evict(t, 2)  # a and b each take 2 of a lease's 5 blocks: 6 free in all, 3 per lease
    assert DONOR in a.res and DONOR in b.res and t.donor.available_tokens() == 6
    plan = evict(t, 4)  # the 4-token victim fits a lease only once that lease's copy is dropped
    assert [s.dst_tier for s in plan.copies] == [DONOR] and plan.dropped == 0
    assert DONOR in big.res and (DONOR in a.res) != (DONOR in b.res)
    t.check_integrity()


# ---- cost-aware ---------------------------------------------------------------------------------


def cost_tree(**kw) -> RadixTree:
    return tree(eviction="cost_aware", demotion="cost_aware", donor=True, **kw)


def test_cost_aware_evicts_a_node_with_a_lower_copy_before_an_older_one_without():
    t = cost_tree()
    t.donor.add_lease("stable", 0, 1, 2, reclaim_hazard=0.0)  # full once `old` is on it
    old, new = fill(t, [1, 1], [2, 2])
    evict(t, 2)  # LRU would take `old` again next; demote it to the donor now
    m = t.match([1, 1])
    tk = t.begin_load_back(m.last_node, [10, 11])
    t.unlock(t.complete_load_back(tk).last_node)  # `old` back on device, with a donor copy
    t.match([2, 2])  # `new` is touched after `old`
    t.match([1, 1])  # ... and `old` after that: LRU would now evict `new`
    plan = evict(t, 2)
    assert not plan.copies, "the victim already had a donor copy: nothing to copy"
    assert DEVICE not in old.res and DEVICE in new.res
    t.check_integrity()


def test_cost_aware_keeps_prefixes_whose_only_copy_is_on_a_flaky_donor():
    t = cost_tree()
    t.donor.add_lease("flaky", 0, 1, 2, reclaim_hazard=0.9)
    flaky, stable = fill(t, [1, 1], [2, 2])
    evict(t, 2)  # `flaky` (least recent) goes to the only donor there is
    t.donor.add_lease("stable", 0, 1, 2, reclaim_hazard=0.0)
    evict(t, 2)  # `stable` goes to the stable donor
    assert (flaky.res[DONOR].donor, stable.res[DONOR].donor) == ("flaky", "stable")
    for node, slots in ((flaky, [20, 21]), (stable, [30, 31])):
        t.unlock(t.complete_load_back(t.begin_load_back(node, slots)).last_node)
    t.match([1, 1])
    t.match([2, 2])  # the flaky-backed node is now the least recent: LRU would evict it
    plan = evict(t, 2)  # cost-aware evicts the stable-backed one, cheap to bring back
    assert DEVICE in flaky.res and DEVICE not in stable.res and not plan.copies
    t.check_integrity()


def test_cost_aware_demotion_prefers_stable_donor_and_host_over_a_flaky_donor():
    t = cost_tree(host_capacity=4)
    t.donor.add_lease("flaky", 0, 1, 8, reclaim_hazard=0.9)
    t.donor.add_lease("stable", 0, 1, 2, reclaim_hazard=0.0)
    fill(t, [1, 1], [2, 2], [3, 3])
    plan = evict(t, 2)
    assert plan.copies[0].dst.donor == "stable"
    plan = evict(t, 2)
    # stable is full; making room there would drop a copy worth more than the host's fetch cost
    assert plan.copies[-1].dst_tier in (DONOR, HOST)
    if plan.copies[-1].dst_tier == DONOR:
        assert plan.copies[-1].dst.donor == "stable"
    plan = evict(t, 2)
    assert all(c.dst_tier != DONOR or c.dst.donor != "flaky" for c in plan.copies)
    t.check_integrity()


def test_cost_aware_moves_a_victims_flaky_copy_to_a_stable_donor_with_room():
    t = cost_tree()
    t.donor.add_lease("flaky", 0, 1, 2, reclaim_hazard=0.9)
    (node,) = fill(t, [1, 1])
    evict(t, 2)
    assert node.res[DONOR].donor == "flaky"
    t.unlock(t.complete_load_back(t.begin_load_back(node, [5, 6])).last_node)
    t.donor.add_lease("stable", 0, 1, 2, reclaim_hazard=0.0)
    plan = t.evict_device(2)
    assert [c.dst.donor for c in plan.copies] == ["stable"]
    assert node.res[DONOR].donor == "flaky", "the flaky copy stays until the new one is real"
    released = t.complete_store(plan.stores[0]).released
    assert [r.residency.donor for r in released if r.tier == DONOR] == ["flaky"]
    assert len(t.donor.leases[("flaky", 0)].free_blocks) == 2 and node.res[DONOR].donor == "stable"
    t.check_integrity()


def test_lru_keeps_a_victims_existing_copy_whatever_donor_holds_it():
    t = tree(donor=True)
    t.donor.add_lease("flaky", 0, 1, 2, reclaim_hazard=0.9)
    (node,) = fill(t, [1, 1])
    evict(t, 2)
    t.unlock(t.complete_load_back(t.begin_load_back(node, [5, 6])).last_node)
    t.donor.add_lease("stable", 0, 1, 2, reclaim_hazard=0.0)
    assert not evict(t, 2).copies and node.res[DONOR].donor == "flaky"


def test_cost_aware_room_making_drops_flaky_copies_first():
    t = cost_tree()
    t.donor.add_lease("flaky", 0, 1, 2, reclaim_hazard=0.8)
    fill(t, [1, 1], [2, 2])
    evict(t, 2)
    t.donor.add_lease("stable", 0, 1, 2, reclaim_hazard=0.1)
    evict(t, 2)
    t.match([1, 1])  # the flaky copy is the more recent one; LRU would drop the stable one
    made = t.make_room(DONOR, 2)
    assert {s.residency.donor for s in made.steps} == {"flaky"}
    t.check_integrity()


# ---- registry and config ------------------------------------------------------------------------


def test_unknown_policy_names_fail_with_the_choices():
    with pytest.raises(ValueError, match="cost_aware"):
        TreeConfig(eviction="lfu")
    with pytest.raises(ValueError, match="tiered"):
        TreeConfig(demotion="random")


def test_cost_model_rejects_tiers_dearer_than_recompute():
    with pytest.raises(ValueError):
        CostModel(donor=2.0)
    assert CostModel().donor_expected(0.0) < CostModel().host < CostModel().donor_expected(0.5)
