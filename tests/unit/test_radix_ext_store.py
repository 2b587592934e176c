"""Two-phase stores (demotions) in radix_ext, one contract each."""

from __future__ import annotations

from radix_ext import DEVICE, DONOR, HOST, RadixTree, TreeConfig


def _donor_tree(blocks: int = 8, host: int = 0) -> RadixTree:
    t = RadixTree(TreeConfig(donor=True, host_capacity=host))
    t.donor.add_lease("d", 0, 1, blocks)
    return t


def test_a_store_in_flight_keeps_the_device_copy_pinned_until_it_completes():
    t = _donor_tree()
    t.insert([1, 2, 3], [10, 11, 12])
    plan = t.evict_device(3)
    (ticket,) = plan.stores
    assert plan.num_evicted == 3 and not len(plan.device_indices_to_free())
    m = t.match([1, 2, 3])
    assert m.device_len == 3 and not m.loads, "the KV is still on the device: still a device hit"
    assert t.evictable_size() == 0 and t.evict_device(3).num_evicted == 0, "evicted twice"
    out = t.complete_store(ticket)
    assert out.ok and sorted(out.device_indices_to_free()) == [10, 11, 12]
    m = t.match([1, 2, 3])
    assert m.device_len == 0 and [s.tier for s in m.loads] == [DONOR]
    assert m.loads[0].source is ticket.dst
    t.check_integrity()


def test_abort_gives_the_blocks_back_to_the_lease_and_drops_a_node_with_no_other_copy():
    t = _donor_tree(blocks=4)
    t.insert([1, 2, 3], [10, 11, 12])
    (ticket,) = t.evict_device(3).stores
    assert t.donor.available_tokens() == 1
    out = t.abort_store(ticket)
    assert not out.ok and sorted(out.device_indices_to_free()) == [10, 11, 12]
    assert t.donor.available_tokens() == 4 and t.donor.capacity_tokens() == 4, "not a revoke"
    assert t.match([1, 2, 3]).prefix_len == 0
    t.check_integrity()


def _on_device_with_copy_in(t: RadixTree, key: list, tier: str):
    """Put `key` in `tier` only, then load it back: on the device with a write-through copy."""
    t.insert(key, range(len(key)))
    assert t.complete_store(t.evict_device(len(key)).stores[0]).ok
    m = t.match(key)
    assert m.tokens_from(tier) == len(key)
    t.complete_load_back(t.begin_load_back(m.last_node, range(10, 10 + len(key))))
    t.unlock(m.last_node)
    return m.last_node


def test_abort_keeps_the_copy_the_node_already_had():
    t = RadixTree(TreeConfig(donor=True, host_capacity=8, demotion="cost_aware"))
    node = _on_device_with_copy_in(t, [1, 2], HOST)
    t.donor.add_lease("d", 0, 1, 4)  # a cheaper place than the host copy it has
    (ticket,) = t.evict_device(2).stores
    assert ticket.dst_tier == DONOR
    out = t.abort_store(ticket)
    assert sorted(out.device_indices_to_free()) == [10, 11]
    assert set(node.res) == {HOST} and t.donor.available_tokens() == 4
    t.check_integrity()


def test_complete_replaces_a_worse_copy_in_the_same_tier_only_when_the_new_one_is_real():
    t = RadixTree(TreeConfig(donor=True, demotion="cost_aware"))
    t.donor.add_lease("flaky", 0, 1, 4, reclaim_hazard=0.9)
    node = _on_device_with_copy_in(t, [1, 2], DONOR)
    t.donor.add_lease("stable", 0, 1, 4)
    (ticket,) = t.evict_device(2).stores
    assert ticket.dst.donor == "stable" and node.res[DONOR].donor == "flaky", "old copy kept"
    out = t.complete_store(ticket)
    assert [r.residency.donor for r in out.released if r.tier == DONOR] == ["flaky"]
    assert node.res[DONOR].donor == "stable" and len(t.donor.leases[("flaky", 0)].free_blocks) == 4
    t.check_integrity()


def test_a_node_locked_while_its_store_is_in_flight_stays_on_the_device():
    t = _donor_tree()
    node = t.insert([1, 2], [0, 1]).last_node
    (ticket,) = t.evict_device(2).stores
    t.lock(t.match([1, 2]).last_device_node)
    out = t.complete_store(ticket)
    assert out.ok and not len(out.device_indices_to_free())
    assert set(node.res) == {DEVICE, DONOR}, "a write-through copy, the device copy kept"
    t.unlock(node)
    t.check_integrity()


def test_a_revoke_makes_the_store_stale_and_completing_it_fails_like_an_abort():
    t = _donor_tree(blocks=4)
    t.insert([1, 2], [0, 1])
    (ticket,) = t.evict_device(2).stores
    r = t.revoke("d", 0, [ticket.dst.blocks[0]])
    assert ticket.stale and ticket.ticket_id in r.stale_tickets and not r.lost
    out = t.complete_store(ticket)
    assert not out.ok and sorted(out.device_indices_to_free()) == [0, 1]
    assert t.donor.capacity_tokens() == 3 and t.donor.available_tokens() == 3
    assert t.match([1, 2]).prefix_len == 0
    t.check_integrity()


def test_a_parent_leaves_only_after_its_children_whatever_order_stores_settle_in():
    t = _donor_tree()
    t.insert([1, 2], [0, 1])
    t.insert([1, 2, 3, 4], [0, 1, 2, 3])
    plan = t.evict_device(4)
    child, parent = plan.stores  # the leaf first, then its parent in the same pass
    assert plan.num_evicted == 4
    out = t.complete_store(parent)
    assert out.ok and not len(out.device_indices_to_free()), "the child still needs the parent"
    assert t.match([1, 2, 3, 4]).device_len == 4
    out = t.complete_store(child)
    assert sorted(out.device_indices_to_free()) == [0, 1, 2, 3]
    assert t.match([1, 2, 3, 4]).device_len == 0
    t.check_integrity()


def test_a_match_splitting_a_node_in_flight_splits_its_store():
    t = _donor_tree()
    t.insert([1, 2, 3, 4], [0, 1, 2, 3])
    (ticket,) = t.evict_device(4).stores
    assert t.match([1, 2, 9]).device_len == 2  # splits the leaving node
    t.check_integrity()
    assert sorted(t.complete_store(ticket).device_indices_to_free()) == [0, 1, 2, 3]
    m = t.match([1, 2, 3, 4])
    assert m.device_len == 0 and m.tokens_from(DONOR) == 4 and len(m.loads) == 2
    t.check_integrity()


def test_an_insert_under_a_leaving_node_keeps_it_and_it_is_not_evictable_until_settled():
    t = _donor_tree(blocks=2)
    t.insert([1, 2], [0, 1])
    (ticket,) = t.evict_device(2).stores
    t.insert([1, 2, 3, 4], [7, 8, 2, 3])  # a device child appears under the leaving node
    assert t.evictable_size() == 2 and t.protected_size() == 2
    assert t.evict_device(4).num_evicted == 2, "the held parent must not count as evictable"
    t.check_integrity()
