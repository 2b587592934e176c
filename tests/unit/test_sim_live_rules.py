"""The live borrower's rules the CPU-node simulation follows (`Node.lend`: one lease sized in
the donor's pages; server.py `alloc_per_step`), and the radix_ext behaviour that makes the lease
structure matter (docs/simulation.md section 10)."""

from array import array

import pytest
from unit.test_sim_cpu_node import _calibration

from benchmarks.simulator.cpu_calibration import compute_for
from benchmarks.simulator.cpu_node import _node, _server
from benchmarks.simulator.server import SimRequest
from radix_ext import RadixTree, TreeConfig


def _cpu_pair(alloc_per_step: bool = True):
    cal, _ = _calibration()
    node = _node(cal)
    busy = _server(node, 0, "busy", compute_for(cal, "busy"), 1024, True)
    busy.alloc_per_step = alloc_per_step
    donor = _server(node, 1, "donor", compute_for(cal, "donor"), 4096, False)
    return node, busy, donor


def test_a_live_lend_gives_the_tree_the_live_leases_and_a_reclaim_takes_all_back():
    """bench_node's sizes (busy 8 KiB per token, donor 2 KiB, half of 4096 donor tokens lent):
    the tree gets the live run's one lease of 512 blocks (2048 donor pages); a donor under
    pressure takes every block back."""
    node, busy, donor = _cpu_pair()
    assert node.lend(donor, busy, 0.5, 0.8) == 512
    assert sorted(x.num_blocks for x in busy.cache.tree.donor.leases.values()) == [512]
    assert len(donor.lent_pages) == 2048
    node._reclaim(node.donations["donor"], busy, len(donor.lent_pages))
    assert busy.cache.tree.donor.capacity_tokens() == 0 and not donor.lent_pages
    busy.cache.check_integrity()
    node.donations["donor"].ledger.check_integrity()


def test_a_victim_larger_than_every_leases_free_blocks_is_dropped_not_stored():
    """radix_ext places a node's donor copy in one lease: with two leases of 4 free blocks
    (8 together), a 6-token victim is not stored but dropped. The live lease split makes this
    happen to about half the busy model's victims (docs/simulation.md section 10)."""
    tree = RadixTree(TreeConfig(page_size=1, donor=True))
    tree.donor.add_lease("d", 1, 1, 4)
    tree.donor.add_lease("d", 2, 1, 4)
    tree.insert(array("q", range(6)), array("q", range(6)))
    plan = tree.evict_device(6)
    assert (plan.num_evicted, plan.dropped, tree.tier_size("donor")) == (6, 6, 0)
    tree.check_integrity()


def _request(prompt: int, out: int) -> SimRequest:
    ids = list(range(100, 100 + prompt + out))
    return SimRequest(0, "s", 1, 0.0, prompt, out, key_prompt=array("q", ids[:prompt - 1]),
                      key_full=array("q", ids[:prompt + out - 1]))


@pytest.mark.parametrize("per_step", [True, False])
def test_sglang_order_allocates_an_output_slot_per_decode_step(per_step):
    """With `alloc_per_step` (SGLang's order) a request holds its prompt's slots after its
    prefill, plus one per decode step begun (the first begins as the prefill ends); without,
    prompt and output are allocated at admission. Either way it caches prompt + all but its
    last answer token and frees the rest."""
    node, busy, _ = _cpu_pair(per_step)
    busy.submit(_request(100, 8))
    node.loop.run()
    first, finish = busy.done[0].first_token, busy.done[0].finish
    node, busy, _ = _cpu_pair(per_step)
    busy.submit(_request(100, 8))
    node.loop.run(until=first)
    held = [1024 - busy.cache.free_pages()]
    node.loop.run(until=(first + finish) / 2)
    held.append(1024 - busy.cache.free_pages())
    if per_step:
        assert held[0] == 101 and 101 < held[1] < 107
    else:
        assert held == [108, 108]
    node.loop.run()
    assert busy.cache.tree.device_size() == 107 and busy.cache.free_pages() == 1024 - 107
    busy.cache.check_integrity()
