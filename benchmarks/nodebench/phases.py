"""Where a request's time to first token goes: one timeline per request, phase statistics, and
the phase that separates two runs.

A request's timeline (Unix seconds) joins three sources:
- the client: `sent`, and `first_token` (sent + TTFT);
- SGLang's own per-request times (`meta_info` with `--enable-metrics`): `received` (the
  tokenizer got it), `queued` (it entered the scheduler's waiting queue: `forward_entry_time -
  queue_time`), `admitted` (`forward_entry_time`: its prefill batch was built), `prefilled`
  (`prefill_finished_time`: the prefill's result was processed);
- the server's traces: the prefill forward that carried it (the forward trace, an EXTEND
  forward ending after `admitted`: `forward_start`, `forward_end`), and for a borrower its
  donor load or exchange (the batch-load trace: `load_start`, `load_end` = the last layer
  ready, `load_kind`, and `load_stall_ms`, how long attention waited for layers).

`finished` (sent + the time to its last token) ends the request.

The TTFT splits into consecutive phases (they add up to it): `to_server` (sent -> received),
`to_scheduler` (-> queued), `queue` (-> admitted: waiting for admission, behind the forwards
running, and admission's own work: matching, making room), `batch_start` (-> forward_start),
`forward` (-> forward_end), `after_forward` (-> prefilled), `to_client` (-> first_token).
Without a forward trace, `prefill` (admitted -> prefilled) replaces the three in between.
`load` and `load_stall` overlap the forward (requests with a donor load or exchange only).
"""

from __future__ import annotations

from typing import Iterable

from ..loadgen.stats import pct

SEQUENCE = ("to_server", "to_scheduler", "queue", "batch_start", "forward", "after_forward",
            "to_client")
COARSE = ("to_server", "to_scheduler", "queue", "prefill", "to_client")
OVERLAPPING = ("load", "load_stall")


def timeline(turn: dict, forwards: list[dict], loads: dict[str, dict]) -> dict:
    """One request's timeline (see the module docstring) from its turn record (`multiturn.Turn`
    as a dict), the server's EXTEND forwards (`{"start", "end"}`, Unix seconds, sorted by end)
    and its batch loads by request id (`load_index`)."""
    meta = turn.get("meta") or {}
    t = {"sent": turn["t_send"], "first_token": turn["t_send"] + turn["ttft"]}
    if turn.get("latency") is not None:
        t["finished"] = turn["t_send"] + turn["latency"]  # its last token came back
    if "request_received_ts" in meta:
        t["received"] = meta["request_received_ts"]
    if "forward_entry_time" in meta:
        t["admitted"] = meta["forward_entry_time"]
        if "queue_time" in meta:
            t["queued"] = meta["forward_entry_time"] - meta["queue_time"]
    if "prefill_finished_time" in meta:
        t["prefilled"] = meta["prefill_finished_time"]
    if meta.get("num_retractions"):  # its queue_time then adds up every wait, so `queued` is
        t["retractions"] = meta["num_retractions"]  # earlier than its first arrival there
    fwd = prefill_forward(forwards, t.get("admitted"), t.get("prefilled"))
    if fwd is not None:
        t["forward_start"], t["forward_end"] = fwd["start"], fwd["end"]
    load = loads.get(turn.get("rid") or "")
    if load is not None:
        t.update(load_start=load["start"], load_end=load["end"], load_kind=load["kind"],
                 load_tokens=load["tokens"], load_stall_ms=load["stall_ms"])
    return t


def prefill_forward(forwards: list[dict], admitted: float | None,
                    prefilled: float | None) -> dict | None:
    """The first EXTEND forward that ends after `admitted` and no later than `prefilled`
    (the forward that ran the request's prefill), or None."""
    if admitted is None or prefilled is None:
        return None
    for f in forwards:
        if admitted <= f["end"] <= prefilled + 1e-3:
            return f
    return None


def load_index(batches: Iterable[dict]) -> dict[str, dict]:
    """Request id -> its donor load or exchange, from batch-load trace lines (the product's
    `batch_load` facts with `t0`, the batch's start in Unix time, and `loads`, one per request);
    the load's end is the batch's last layer ready; its stall is attention's wait per layer
    (ready after reached) summed."""
    out: dict[str, dict] = {}
    for b in batches:
        if "t0" not in b or "loads" not in b:
            continue
        ready = [x for x in b.get("ready_ms") or [] if x is not None]
        reached = b.get("reached_ms") or []
        stall = sum(max(0.0, r - a) for r, a in zip(b.get("ready_ms") or [], reached)
                    if r is not None and a is not None)
        end = b["t0"] + (max(ready) if ready else 0.0) / 1e3
        for one in b["loads"]:
            out[one["rid"]] = {"start": b["t0"], "end": end, "kind": one["kind"],
                               "tokens": one["tokens"], "stall_ms": stall}
    return out


def phases_ms(t: dict) -> dict[str, float]:
    """The phases of one timeline, in ms (only those whose two ends are known)."""
    fine = "forward_start" in t and "admitted" in t and "prefilled" in t
    marks = (("sent", "received", "to_server"), ("received", "queued", "to_scheduler"),
             ("queued", "admitted", "queue"))
    if fine:
        marks += (("admitted", "forward_start", "batch_start"),
                  ("forward_start", "forward_end", "forward"),
                  ("forward_end", "prefilled", "after_forward"))
    else:
        marks += (("admitted", "prefilled", "prefill"),)
    marks += (("prefilled", "first_token", "to_client"),)
    out = {name: (t[b] - t[a]) * 1e3 for a, b, name in marks if a in t and b in t}
    if "load_start" in t:
        out["load"] = (t["load_end"] - t["load_start"]) * 1e3
        out["load_stall"] = t["load_stall_ms"]
    return out


def phase_stats(timelines: list[dict]) -> dict[str, dict[str, float | None]]:
    """P50 and P99 (ms) of every phase over the requests that have it, and how many do."""
    per: dict[str, list[float]] = {}
    for t in timelines:
        for name, ms in phases_ms(t).items():
            per.setdefault(name, []).append(ms)
    return {name: {"p50": pct(v, 50), "p99": pct(v, 99), "n": len(v)}
            for name, v in per.items()}


def tail_breakdown(timelines: list[dict], ttfts_ms: list[float], q: float = 90) -> dict:
    """Mean ms per phase over the requests whose TTFT is at or above its `q`th percentile
    (the slow requests a P99 is made of), and how many there are."""
    cut = pct(ttfts_ms, q)
    slow = [t for t, ms in zip(timelines, ttfts_ms) if cut is not None and ms >= cut]
    sums: dict[str, float] = {}
    for t in slow:
        for name, ms in phases_ms(t).items():
            sums[name] = sums.get(name, 0.0) + ms
    return {"requests": len(slow), "ttft_cut_ms": cut,
            "mean_ms": {k: v / len(slow) for k, v in sums.items()} if slow else {}}


def sequential(stats: dict) -> list[str]:
    """The phases of `stats` that add up to a TTFT (the overlapping ones left out)."""
    return [name for name in stats if name not in OVERLAPPING]


def slowest_phase(stats: dict) -> dict | None:
    """The sequential phase with the largest P99 in `stats` (`phase_stats`)."""
    names = [n for n in sequential(stats) if stats[n]["p99"] is not None]
    if not names:
        return None
    name = max(names, key=lambda n: stats[n]["p99"])
    return {"phase": name, "p99_ms": stats[name]["p99"]}


def largest_excess(stats: dict, base: dict) -> dict | None:
    """The sequential phase whose P99 in `stats` exceeds its P99 in `base` by the most
    (ms; negative where every phase is faster), with both P99s."""
    names = [n for n in sequential(stats)
             if n in base and stats[n]["p99"] is not None and base[n]["p99"] is not None]
    if not names:
        return None
    name = max(names, key=lambda n: stats[n]["p99"] - base[n]["p99"])
    return {"phase": name, "excess_ms": stats[name]["p99"] - base[name]["p99"],
            "p99_ms": stats[name]["p99"], "base_p99_ms": base[name]["p99"]}


def queue_behind_running(timelines: list[dict]) -> list[float]:
    """Per request with a known wait for admission (`queued` -> `admitted`), the ms of that wait
    during which another request of the run was running (admitted, not yet finished): a wait
    behind the requests in flight, the device room they hold (the only thing a queued request
    waits for while the batch runs, unless the whole wait is one forward's length)."""
    running = sorted((t["admitted"], t["finished"]) for t in timelines
                     if "admitted" in t and "finished" in t)
    out = []
    for t in timelines:
        if "queued" not in t or "admitted" not in t:
            continue
        a, b = t["queued"], t["admitted"]
        covered, edge = 0.0, a
        for start, end in running:  # the union of the others' running spans within [a, b]
            if start >= b:
                break
            if end <= edge:  # its own span starts at `b`: never counted
                continue
            lo = max(start, edge)
            covered += max(0.0, min(end, b) - lo)
            edge = max(edge, min(end, b))
        out.append(covered * 1e3)
    return out
