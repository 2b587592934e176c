"""Donated memory in live servers, across two different models: a donor SGLang server lends idle
pages of its OWN KV pool to a borrower serving a bigger model.

Real SGLang CPU servers: a donor on the tiny model (4 layers, 2 KV heads of 32) and a borrower on
the small model (8 layers, 4 KV heads of 32; a page of it is 4x the donor's) whose pool is too
small for the conversations, plus stock SGLang on the small model with the same small pool as
the reference. Invariants:
- the two SwiftCache servers find each other and agree on a lease; the lent pages come out of
  the donor's own pool (`ctl status`: lent > 0, usable = pool - lent);
- the borrower's greedy outputs equal stock SGLang's, turn by turn: donated memory never changes
  a token (`same_greedy`: but for a near-tie that stock SGLang's own CPU kernels can flip between
  two runs, at most MAX_TIES per phase; each turn's history carries stock's answer);
- prefixes evicted from the borrower's pool come back from the donor's pool: the borrower
  reports more cached tokens than stock SGLang with the same pool;
- a burst of the donor's own traffic takes its memory back: every lent page returns to its pool
  (usable = pool) and the borrower, having dropped what it kept there, stays token-identical;
- the donor lends again after its cooldown; killed with SIGKILL while lending, the borrower
  declares the lease lost and keeps serving, still token-identical.
"""

from __future__ import annotations

import json
import os

import pytest
from integration.harness import LocalServer, chat, metric, reply_text, same_greedy, wait_for

from benchmarks.tools.demo import ctl, wait_for_lease
from benchmarks.tools.local_server import starting
from benchmarks.tools.tiny_model import ensure_tiny_model
from benchmarks.workloads.sharegpt import load_conversations

pytestmark = pytest.mark.integration
SMALL_POOL = 450  # tokens: five conversations' histories do not fit, so the tree must evict
MAX_TOKENS = 8
TOP_LOGPROBS = 5
# stock SGLang's own greedy answer can flip at a near-tie between its runs on CPU (a fresh stock
# server replaying the same turns has answered what the borrower had)
MAX_TIES = 1


def _args(rendezvous: str, role: str, *extra: str) -> list[str]:
    return ["--enable-cache-report", "--dtype", "float32", "--swiftcache-role", role,
            "--swiftcache-rendezvous-dir", rendezvous,
            # a loaded 2-core CI machine can starve the agent thread for a second or more
            "--swiftcache-heartbeat-timeout-s", "3", "--swiftcache-heartbeat-interval-s", "0.3",
            *extra]


def _replay(server, convs, turns, forced: list[dict] | None = None) -> list[dict]:
    """Interleave conversations turn by turn, so each one's prefix is evicted before it returns.
    Each history carries the answers in `forced` (a reference replay's responses) where given,
    else the server's own: one turn's near-tie (`same_greedy`) does not change later prompts."""
    histories = [[] for _ in convs]
    responses = []
    for t in range(turns):
        for conv, msgs in zip(convs, histories):
            if t >= len(conv.turns):
                continue
            msgs.append({"role": "user", "content": conv.turns[t].user})
            resp = chat(server, msgs, MAX_TOKENS, top_logprobs=TOP_LOGPROBS)
            source = forced[len(responses)] if forced is not None else resp
            responses.append(resp)
            msgs.append({"role": "assistant", "content": reply_text(source)})
    return responses


def _cached(responses: list[dict]) -> int:
    return sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
               for r in responses)


def _check(got: list[dict], want: list[dict]) -> None:
    """Token-identical to stock SGLang's, but for at most MAX_TIES near-ties (`same_greedy`)."""
    ties = same_greedy(got, want)
    assert len(ties) <= MAX_TIES, f"near-ties at requests {ties}: more than float noise explains"


DONOR_POOL = 4096


def _lending_donor(model, rendezvous: str, log_path, *extra: str,
                   pool: int = DONOR_POOL) -> LocalServer:
    """A donor that lends up to half of its pool and keeps the other half free for its own
    traffic (so a burst of its own takes every lent page back), lending nothing again for ten
    minutes after a reclaim."""
    return LocalServer(model, max_total_tokens=pool, log_path=log_path,
                       extra_args=_args(rendezvous, "donor", *extra,
                                        "--swiftcache-lend-fraction", "0.5",
                                        "--swiftcache-reclaim-watermark", "0.5",
                                        "--swiftcache-relend-cooldown-s", "600",
                                        "--enable-metrics"))


def borrowing_server(model, rendezvous: str, log_path, *extra: str) -> LocalServer:
    """A borrower on `model` with the small pool (SMALL_POOL tokens) and its metrics, borrowing
    up to 1500 blocks."""
    return LocalServer(model, max_total_tokens=SMALL_POOL, log_path=log_path,
                       extra_args=_args(rendezvous, "borrower", "--enable-metrics",
                                        "--swiftcache-max-borrow-blocks", "1500", *extra))


def replay_once_borrowing(rendezvous: str, borrower, convs, ref: list[dict]) -> list[dict]:
    """Once `borrower` holds a lease (`ctl status`) and reports borrowed pages: its replay of
    `convs` for 3 turns, each history carrying `ref`'s answers."""
    from benchmarks.tools.demo import wait_for_lease

    wait_for_lease(rendezvous, timeout_s=90)
    wait_for(lambda: metric(borrower, "swiftcache_borrowed_tokens"), 30,
             "the borrower to report the pages it borrowed")
    return _replay(borrower, convs, 3, forced=ref)


STOCK_ARGS = ("--enable-cache-report", "--dtype", "float32")


def _stock_server(model, log_path, pool: int = SMALL_POOL,
                  extra: tuple[str, ...] = ()) -> LocalServer:
    """Stock SGLang on `model` with a pool of `pool` tokens: a reference of this test's own."""
    return LocalServer(model, swiftcache=False, max_total_tokens=pool,
                       extra_args=[*STOCK_ARGS, *extra], log_path=log_path)


def stock_replay(stock_servers, model, convs, turns: int, pool: int = SMALL_POOL,
                 extra: tuple[str, ...] = ()) -> list[dict]:
    """Stock SGLang's answers to `_replay(server, convs, turns)` on `model` with the
    borrower's pool: the session's shared stock server (`conftest.StockServers`), once per
    session for the same replay."""
    args = (*STOCK_ARGS, *extra)
    key = ("replay", str(model), pool, args, turns,
           tuple(tuple(turn.user for turn in conv.turns) for conv in convs))
    return stock_servers.memo(key, lambda: _replay(stock_servers.get(model, pool, args), convs,
                                                   turns))


def _stock_replays(stock_servers, model, convs, first: int, then: int, pool: int = SMALL_POOL,
                   extra: tuple[str, ...] = ()) -> tuple[list[dict], list[dict]]:
    """Stock's replay of `convs` for `then` turns (`stock_replay`), and its first `first` turns
    as the reference of a replay that stops there (`_replay` goes turn by turn over every
    conversation, so those are the same prompts)."""
    tail = stock_replay(stock_servers, model, convs, then, pool, extra)
    return tail[:_turn_requests(convs, first)], tail


def _turn_requests(convs, turns: int) -> int:
    """How many requests `_replay(server, convs, turns)` sends."""
    return sum(min(turns, len(conv.turns)) for conv in convs)


def _capacity(rendezvous: str, role_model: str) -> dict:
    """The `capacity` a server reports through `ctl status --json` (its own tokens)."""
    try:
        agents = json.loads(ctl(rendezvous, json_out=True))
    except ValueError:  # ctl could not answer this time
        return {}
    for agent in agents:
        if agent.get("model", "").rstrip("/").endswith(role_model) and agent.get("capacity"):
            return agent["capacity"]
    return {}


def _donor_burst(donor, n: int = 3) -> None:
    """The donor's own traffic: a few concurrent long prompts that need most of its free room."""
    import concurrent.futures as cf

    prompt = " ".join(f"word{i}" for i in range(300))
    with cf.ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda _: chat(donor, [{"role": "user", "content": prompt}], 48), range(n)))


def test_borrower_uses_donor_memory_and_survives_donor_death(tiny_model, tmp_path,
                                                            stock_servers):
    rendezvous = str(tmp_path / "rv")
    small_model = ensure_tiny_model(shape="small")
    convs = load_conversations(5, min_turns=4, max_chars_per_message=200)
    # the donor keeps half its pool free for itself (watermark 0.5), so its own burst reclaims
    donor = LocalServer(tiny_model, max_total_tokens=DONOR_POOL, log_path=tmp_path / "donor.log",
                        extra_args=_args(rendezvous, "donor", "--swiftcache-lend-fraction", "0.5",
                                         "--swiftcache-reclaim-watermark", "0.5",
                                         "--swiftcache-relend-cooldown-s", "2",
                                         "--enable-metrics"))
    borrower = borrowing_server(small_model, rendezvous, tmp_path / "b.log")
    with starting(donor, borrower) as ready:  # they start while stock answers
        ref, _ = _stock_replays(stock_servers, small_model, convs, 3, 4)
        ref_tail = stock_replay(stock_servers, small_model, convs[:2], 4)
        ready()
        agents = wait_for_lease(rendezvous, timeout_s=90)  # through `ctl status`
        assert agents[0]["leases"], agents
        lent = wait_for(lambda: _capacity(rendezvous, "tiny-llama").get("lent_tokens"), 30,
                     "the donor to report lent pages of its own pool")
        cap = _capacity(rendezvous, "tiny-llama")
        assert cap["kv_pool_tokens"] == DONOR_POOL and cap["usable_tokens"] == DONOR_POOL - lent
        # an idle scheduler (--sleep-on-idle) takes its lease in within a second
        def borrowed():
            return _capacity(rendezvous, "small-llama").get("borrowed_tokens")

        wait_for(borrowed, 30, "the borrower to report the pages it borrowed")
        got = _replay(borrower, convs, 3, forced=ref)
        _check(got, ref)
        assert _cached(got) > _cached(ref), (_cached(got), _cached(ref))
        loaded = wait_for(lambda: metric(borrower, "swiftcache_loaded_tokens_total"), 30,
                       "swiftcache metrics on the borrower's /metrics")
        assert loaded > 0

        # The donor's own load rises: it takes every lent page back into its own pool.
        _donor_burst(donor)
        # a reclaim latency is recorded when the last lent page is back in the donor's pool
        # (usable == pool at that moment; it may lend again after a cooldown)
        wait_for(lambda: metric(donor, "swiftcache_reclaim_latency_seconds_count") >= 1, 30,
              "the donor's usable capacity to return to its whole pool")
        wait_for(lambda: "reclaimed" in borrower.log_text(), 30, "the borrower to see the reclaim")
        _check(_replay(borrower, convs[:2], 4, forced=ref_tail), ref_tail)

        # After its cooldown the idle donor lends again and the borrower takes the new lease:
        # the donor dies while lending.
        wait_for(borrowed, 30, "the donor to lend again after its relend cooldown")
        donor_pid = donor.proc.pid
        os.killpg(donor_pid, 9)  # SIGKILL the donor server, scheduler included
        donor.proc.wait(30)
        _check(_replay(borrower, convs[:2], 4, forced=ref_tail), ref_tail)
        wait_for(lambda: "lost (" in borrower.log_text(), 30,
                 "the borrower to detect the lost donor")
        # and again, with the donor tier gone
        _check(_replay(borrower, convs[:2], 4, forced=ref_tail), ref_tail)
        assert borrower.proc.poll() is None, borrower.log_tail()
    pids = _pids_in(tmp_path / "donor.log")
    leaked = [f for f in os.listdir("/dev/shm") if f.startswith("swift")
              and any(f"_p{pid}_" in f for pid in pids)]
    assert not leaked, f"the killed donor's pool left in /dev/shm: {leaked}"




def _pids_in(log_path) -> set[int]:
    """Scheduler pids a server log names (the donor's arena carries its scheduler's pid)."""
    import re

    return {int(m) for m in re.findall(r"in pid (\d+) with", log_path.read_text())}


def own_burst(server, *, prompts: int, words: int, max_tokens: int) -> list[dict]:
    """A donor's own traffic: `prompts` concurrent prompts of `words` words each, answered
    greedily with top logprobs (`same_greedy`)."""
    import concurrent.futures as cf

    texts = [" ".join(f"item{i + 7 * j}" for i in range(words)) for j in range(prompts)]
    with cf.ThreadPoolExecutor(prompts) as pool:
        return list(pool.map(lambda p: chat(server, [{"role": "user", "content": p}],
                                            max_tokens, top_logprobs=TOP_LOGPROBS), texts))


def donor_kind_lends(tmp_path, stock_servers, donor_model, burst, *, pool: int,
                     bursts: int = 1, server_args: tuple[str, ...] = (),
                     borrower_model=None) -> dict:
    """The live check of a donor of another model kind (`donor_model`, served with
    `server_args`, `burst(server)` its own traffic): it lends pages of its pool of `pool`
    tokens to a borrower (`borrower_model`, default the GQA `small`, on the small pool), whose
    answers are stock SGLang's while it loads prefixes back from them and after the donor's own
    burst took every page back; then the donor's `bursts` bursts of its own (the first one
    reclaims) against a stock server's on the same model. Returns the near-ties of each burst
    (`same_greedy`, "ties") for the caller to bound, and the borrower's cached prompt tokens
    in its first replay beside stock's ("cached", "stock_cached")."""
    from benchmarks.tools.demo import wait_for_lease
    from benchmarks.tools.tiny_model import ensure_tiny_model
    from benchmarks.workloads.sharegpt import load_conversations

    name = donor_model.name
    borrower_model = borrower_model or ensure_tiny_model(shape="small")
    convs = load_conversations(5, min_turns=4, max_chars_per_message=200)
    rendezvous = str(tmp_path / "rv")
    donor = _lending_donor(donor_model, rendezvous, tmp_path / "donor.log", *server_args,
                           pool=pool)
    borrower = borrowing_server(borrower_model, rendezvous, tmp_path / "b.log")
    stock_donor = _stock_server(donor_model, tmp_path / f"stock-{name}.log", pool, server_args)
    with starting(donor, borrower) as ready:  # they start while the stock servers answer
        with starting(stock_donor) as stock_ready:
            ref, ref_tail = _stock_replays(stock_servers, borrower_model, convs, 3, 4)
            stock_ready()
            ref_burst = burst(stock_donor)
        ready()
        wait_for_lease(rendezvous, timeout_s=90)
        lent = wait_for(lambda: _capacity(rendezvous, name).get("lent_tokens"), 30,
                        f"the {name} donor to report lent pages of its pool")
        assert _capacity(rendezvous, name)["usable_tokens"] == pool - lent
        got = replay_once_borrowing(rendezvous, borrower, convs, ref)
        _check(got, ref)
        loaded = wait_for(lambda: metric(borrower, "swiftcache_loaded_tokens_total"), 30,
                          f"prefixes loaded back from the {name} donor's pages")
        bursts_got = [burst(donor)]  # its own traffic takes every lent page back
        wait_for(lambda: metric(donor, "swiftcache_reclaim_latency_seconds_count") >= 1, 30,
                 "the donor to take its pages back")
        wait_for(lambda: "reclaimed" in borrower.log_text(), 30, "the borrower to see the reclaim")
        _check(_replay(borrower, convs, 4, forced=ref_tail), ref_tail)
        bursts_got += [burst(donor) for _ in range(bursts - 1)]  # its pages all back
        assert donor.proc.poll() is None and borrower.proc.poll() is None
        assert "memory leak" not in donor.log_text(), donor.log_tail()
    ties = [same_greedy(answers, ref_burst) for answers in bursts_got]
    print(f"{name} donor lent {lent} tokens; {borrower_model.name} borrower loaded {loaded} "
          f"back, cached {_cached(got)} prompt tokens against stock's {_cached(ref)}; donor "
          f"burst near-ties {ties}")
    return {"ties": ties, "cached": _cached(got), "stock_cached": _cached(ref)}
