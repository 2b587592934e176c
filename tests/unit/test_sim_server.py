"""Simulated servers over the real radix_ext tree: hand-checked timings, tiers, donation."""

from array import array

import pytest

import radix_ext
from benchmarks.simulator.cache_adapter import TreeCache
from benchmarks.simulator.node import Node
from benchmarks.simulator.params import MODELS, gpu
from benchmarks.simulator.roofline import Roofline
from benchmarks.simulator.server import ModelServer, SimRequest

P = 64
H20 = gpu("H20")


def _server(node, g, name="m", model="Qwen3-8B", pages=8, host=0, donor=False, mode="layerwise"):
    rl = Roofline(MODELS[model], H20["bf16_flops"], H20["hbm_bw"], 0.6, 0.7)
    srv = ModelServer(name, node.gpus[g], rl, TreeCache(pages, host, donor=donor), page_tokens=P,
                      chunk=8192, max_running=256, load_mode=mode, node=node)
    node.gpus[g].server = srv
    node.by_name[name] = srv
    return srv


def _req(rid, session, prompt, out, at=0.0):
    base = (session + 1) * 1000
    return SimRequest(rid, str(session), 0, at, prompt, out,
                      key_prompt=array("q", [base + p for p in range((prompt - 1) // P)]),
                      key_full=array("q", [base + p for p in range((prompt + out) // P)]))


def test_single_request_ttft_and_tpot_follow_the_roofline():
    node = Node(200e9, 32e9, 1)
    srv = _server(node, 0)
    r = _req(0, 0, 100, 3)
    srv.submit(r)
    node.loop.run()
    rl = srv.rl
    assert r.ttft == pytest.approx(rl.step_time([(100, 0)]))
    assert r.itls == [pytest.approx(rl.step_time([(1, 101)])),
                      pytest.approx(rl.step_time([(1, 102)]))]
    assert srv.cache.tree.device_size() == 1  # (100 + 3) // 64 full pages cached
    srv.cache.check_integrity()


def test_second_turn_reuses_the_cached_prefix_through_the_tree():
    node = Node(200e9, 32e9, 1)
    srv = _server(node, 0)
    a = _req(0, 0, 200, 10)
    srv.submit(a)
    node.loop.run()
    b = _req(1, 0, 300, 1, at=node.loop.now)
    srv.submit(b)
    node.loop.run()
    assert b.hit_tokens["device"] == 192  # 3 full pages of turn 1's prompt + answer
    assert b.extend == 300 - 192
    assert b.ttft == pytest.approx(srv.rl.step_time([(108, 192)]))
    srv.cache.check_integrity()


def test_host_load_takes_bytes_over_pcie_and_overlaps_layerwise():
    node = Node(200e9, 32e9, 1)
    srv = _server(node, 0, pages=4, host=16)
    a = _req(0, 0, 129, 1)  # caches 2 pages
    srv.submit(a)
    node.loop.run()
    b = _req(1, 1, 200, 1)  # needs 4 pages: evicts (demotes) a's 2 pages to host
    srv.submit(b)
    node.loop.run()
    assert srv.cache.tier_pages("host") == 2
    assert node.bytes_by_route[("device", "host")] == 2 * srv.page_bytes
    c = _req(2, 0, 150, 1)
    c.arrival = node.loop.now
    srv.submit(c)
    node.loop.run()
    assert c.hit_tokens.get("host") == 128
    assert c.load_time == pytest.approx(2 * srv.page_bytes / 32e9)
    t_c = srv.rl.step_time([(22, 128)])
    # evicting b's pages to make room is itself a D2H copy the step waits for
    assert c.ttft >= max(t_c, c.load_time + t_c / srv.rl.model.layers) - 1e-12
    srv.cache.check_integrity()


def test_vllm_mode_loads_before_scheduling():
    node = Node(200e9, 32e9, 1)
    srv = _server(node, 0, pages=8, host=16, mode="before")
    srv.submit(_req(0, 0, 129, 1))
    node.loop.run()
    assert srv.evict(8) == 2  # push the cached pages down to host by hand
    node.loop.run()
    assert srv.cache.tier_pages("host") == 2 and srv.cache.free_pages() == 8
    c = _req(1, 0, 150, 1, at=node.loop.now)
    srv.submit(c)
    node.loop.run()
    t_c = srv.rl.step_time([(22, 128)])
    assert c.ttft == pytest.approx(c.load_time + t_c)


def test_donation_goes_through_the_ledger_and_tree_and_reclaim_revokes():
    node = Node(200e9, 32e9, 2)
    master = _server(node, 0, "master", "Qwen3-32B", pages=4, host=0, donor=True)
    donor = _server(node, 1, "donor", "Qwen3-4B", pages=64, mode="none")
    blocks = node.lend(donor, master, 0.5, 0.8)
    assert blocks == int(0.5 * 64 * donor.page_bytes // master.page_bytes)
    assert master.cache.tree.donor.capacity_tokens() == blocks
    assert len(donor.lent_pages) >= blocks * master.page_bytes / donor.page_bytes
    master.submit(_req(0, 0, 129, 1))
    node.loop.run()
    master.submit(_req(1, 1, 200, 1))  # evicts conversation 0's pages to the donor over NVLink
    node.loop.run()
    assert master.cache.tier_pages("donor") == 2
    assert node.bytes_by_route[("device", "donor")] == 2 * master.page_bytes
    before = master.cache.calls["revoke"]
    node._reclaim(node.donations["donor"], master, len(donor.lent_pages))
    assert master.cache.calls["revoke"] > before
    assert master.cache.tree.donor.capacity_tokens() == 0 and not donor.lent_pages
    master.cache.check_integrity()
    node.donations["donor"].ledger.check_integrity()


def test_donor_steps_slow_down_while_its_hbm_serves_a_copy():
    node = Node(200e9, 32e9, 2)
    donor = _server(node, 1, "donor", "Qwen3-4B", pages=64, mode="none")
    node.net.start([node.gpus[1].nvl_out, node.gpus[0].nvl_in], 1e12)  # 5 s at 200 GB/s
    r = _req(0, 0, 64, 2)
    donor.submit(r)
    node.loop.run(until=1.0)
    free = donor.rl.step_time([(1, 65)])
    assert r.itls[0] == pytest.approx(donor.rl.step_time([(1, 65)], 200e9))
    assert r.itls[0] > free


def test_the_simulator_really_drives_radix_ext(monkeypatch):
    from dataclasses import replace

    from benchmarks.simulator.scenario import PAPER, run_point

    seen = {"match": 0, "evict": 0, "begin": 0, "revoke": 0}
    orig = {k: getattr(radix_ext.RadixTree, k)
            for k in ("match", "evict_device", "begin_load_back")}

    def spy(name, key):
        def f(self, *a, **kw):
            seen[key] += 1
            return orig[name](self, *a, **kw)
        return f

    monkeypatch.setattr(radix_ext.RadixTree, "match", spy("match", "match"))
    monkeypatch.setattr(radix_ext.RadixTree, "evict_device", spy("evict_device", "evict"))
    monkeypatch.setattr(radix_ext.RadixTree, "begin_load_back", spy("begin_load_back", "begin"))
    r = run_point(replace(PAPER, drain_s=300.0), "swiftcache", 2.0, 60.0)
    assert seen["match"] >= r.master["requests"] > 0
    assert seen["evict"] > 0 and seen["begin"] > 0
    assert r.master["hit_rate"].get("donor", 0) > 0
