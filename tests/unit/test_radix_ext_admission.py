"""`radix_ext.admission`: the one admission and eviction sequence, one contract each."""

from __future__ import annotations

from array import array

from radix_ext import DONOR, DevicePool, RadixTree, TreeConfig, admit, evict


class ListPool(DevicePool):
    """A device slot free list; copies succeed unless listed in `fail`."""

    def __init__(self, slots, fail=()):
        self.free_slots = list(slots)
        self.fail = set(fail)
        self.copies = []
        self.reclaimed = []

    def available(self):
        return len(self.free_slots)

    def alloc(self, n):
        if n > len(self.free_slots):
            return None
        out = array("q", self.free_slots[len(self.free_slots) - n:])
        del self.free_slots[len(self.free_slots) - n:]
        return out

    def free(self, indices):
        assert not set(indices) & set(self.free_slots), "a slot freed twice"
        self.free_slots.extend(indices)

    def run_copies(self, copies):
        self.copies.extend(copies)
        return [len(self.copies) - len(copies) + i not in self.fail for i in range(len(copies))]

    def reclaim(self, num_tokens):
        self.reclaimed.append(num_tokens)


def _tree(donor_blocks=0):
    t = RadixTree(TreeConfig(donor=bool(donor_blocks)))
    if donor_blocks:
        t.donor.add_lease("d", 0, 1, donor_blocks)
    return t


def test_admission_locks_the_device_prefix_before_evicting_so_it_survives():
    t = _tree()
    t.insert([1, 2, 3], [0, 1, 2])  # the least recently used leaf: eviction's first pick
    t.insert([7, 8], [3, 4])
    t.match([7, 8])
    pool = ListPool([5])
    a = admit(t, pool, [1, 2, 3, 4], total=5)
    assert a.ok and a.match.device_len == 3 and a.evicted == 2 and len(a.slots) == 2
    assert t.match([1, 2, 3]).device_len == 3, "the prefix being admitted was evicted"
    assert a.anchor.lock_ref == 1 and pool.reclaimed == [2]
    t.unlock(a.anchor)
    t.check_integrity()


def test_a_failed_admission_holds_nothing():
    t = _tree()
    t.insert([1, 2, 3], [0, 1, 2])
    pool = ListPool([5])
    a = admit(t, pool, [1, 2, 3, 4], total=6)  # needs 3 slots: 1 free, nothing else evictable
    assert not a.ok and t.protected_size() == 0 and pool.free_slots == [5]
    assert t.device_size() == 3, "evicted for an admission that could not succeed"
    t.check_integrity()


def _one_demoted_one_on_device(donor_blocks):
    """[1, 2] in donor blocks, [5, 6] on the device, one device slot free."""
    t = _tree(donor_blocks)
    pool = ListPool(range(5))
    t.insert([1, 2], pool.alloc(2))
    evict(t, pool, 2)
    t.insert([5, 6], pool.alloc(2))
    return t, pool


def test_no_second_match_when_the_eviction_left_the_load_part_alone():
    t, pool = _one_demoted_one_on_device(donor_blocks=8)
    clock = t.clock
    a = admit(t, pool, [1, 2], total=5)  # 2 to load + 3 new: evicts [5, 6] to the donor tier
    assert a.ok and a.evicted == 2 and not a.rematched and t.clock == clock + 1
    assert a.load is not None and a.prefix_len == 2 and len(a.slots) == 3
    assert [c.src_tier for c in a.load.copies] == [DONOR]
    assert t.complete_load_back(a.load).ok
    t.check_integrity()


def test_a_second_match_when_the_eviction_dropped_what_was_to_be_loaded():
    t, pool = _one_demoted_one_on_device(donor_blocks=2)
    a = admit(t, pool, [1, 2], total=5)  # demoting [5, 6] makes room by dropping [1, 2]
    assert a.ok and a.evicted == 2 and a.rematched
    assert a.match.prefix_len == 0 and a.load is None and len(a.slots) == 5
    t.check_integrity()


def test_evict_frees_device_slots_only_after_the_stores_settle_and_aborts_failed_copies():
    t = _tree(donor_blocks=8)
    t.insert([1, 2], [0, 1])
    t.insert([3, 4], [2, 3])
    pool = ListPool([], fail={0})
    assert evict(t, pool, 4) == 4
    assert [c.dst_tier for c in pool.copies] == [DONOR, DONOR]
    assert sorted(pool.free_slots) == [0, 1, 2, 3] and t.stores_in_flight() == 0
    cached = [t.match(k).tokens_from(DONOR) for k in ([1, 2], [3, 4])]
    assert sorted(cached) == [0, 2], "the failed copy must not be cached, the other must"
    assert t.donor.capacity_tokens() == 8 and t.donor.available_tokens() == 6, "a revoke"
    t.check_integrity()


def test_holding_keeps_the_part_to_load_while_room_is_made_for_it():
    """Room made for a load under `holding(match)` demotes its victims without dropping the
    matched lower-tier part (without the hold, the full donor tier drops exactly that part);
    the pins are gone afterwards and the load then starts."""
    from radix_ext import holding

    t, pool = _one_demoted_one_on_device(donor_blocks=2)
    m = t.match([1, 2])
    assert m.load_len == 2
    with holding(m):
        evict(t, pool, 2)  # [5, 6] cannot go to the donor tier: dropped instead of [1, 2]
    assert t.match([1, 2]).load_len == 2 and t.match([5, 6]).prefix_len == 0
    a = admit(t, pool, [1, 2], total=5)
    assert a.ok and a.load is not None and a.prefix_len == 2
    assert t.complete_load_back(a.load).ok
    t.check_integrity()
