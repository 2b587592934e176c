#!/usr/bin/env python3
"""Render docs/results.md and the README's generated tables from the records in docs/records/.

    python scripts/render_results.py            # rewrite the pages
    python scripts/render_results.py --check    # exit 1 when a page differs from what it renders
    python scripts/render_results.py --check --fail-stale   # and 2 when a record is not current

A record is what `scripts/record_run.py NAME -- CMD...` wrote: the command, its start (UTC), the
commit, the machine, the load average before and after, and the benchmark's last-line JSON object
(`result`). docs/results.md is docs/results.template.md with each `{{record NAME}}` replaced by
that record's citation and every key of its result with its meaning (RECORDS below), and each
`{{headlines}}`, `{{records}}`, `{{comparison}}` and `{{grid}}` by the tables of headline
figures, of records, of the paper's claims and of the regime grid. In README.md the text between
`<!-- results:begin -->` and `<!-- results:end -->` is the short table of README_FIGURES, and
the text between
`<!-- options:begin -->` and `<!-- options:end -->` is the options table built from
`sglang_swift.config.cli_options()`. A record that does not exist renders as "not yet recorded".

Every record is marked beside its figures: `current` when the product tree it ran on
(`product_tree`, or for records written before that field, the product tree of the commit it
names) is the product tree of the working tree now (or of `--against REV`), **stale** when the
product code changed since, `unknown` when git cannot tell; "uncommitted tree" when its command
ran with uncommitted changes, so the commit it names is not exactly what ran.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
NOT_RECORDED = "not yet recorded"
LONG_VALUE = 160  # characters: a longer value is left in the record, not printed on the page


@dataclass(frozen=True)
class Headline:
    """One headline figure of a record: a label and how to read it from a result."""

    label: str
    read: Callable[[dict], Any]
    readme: bool = True  # also in the one-row summary of its record
    if_present: bool = False  # left out where the record lacks it (a key of older runs only)


@dataclass(frozen=True)
class RecordSpec:
    title: str
    short: str  # its name in the tables of headline figures
    command: str  # how to make the record (run from the repository root)
    doc: str  # where the method is described
    keys: dict[str, str]  # result key -> its meaning; dotted keys name nested values
    headlines: list[Headline] = field(default_factory=list)
    simulated: bool = False
    # keys computed from the result as the page renders (the same for old and new records)
    derive: Callable[[dict], dict] | None = None
    derived_note: str = ""
    table: Callable[[dict], list[str]] | None = None  # lines below the key table


def key(path: str) -> Callable[[dict], Any]:
    def read(result: dict) -> Any:
        value: Any = result
        for part in path.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value

    return read


def of(num: str, den: str, sep: str = "/") -> Callable[[dict], Any]:
    """`num/den` read from two keys, e.g. identical outputs of all compared (`sep` between)."""
    def read(result: dict) -> Any:
        a, b = key(num)(result), key(den)(result)
        return None if a is None or b is None else f"{a}{sep}{b}"

    return read


def _sweep_curve(field_: str) -> Callable[[dict], Any]:
    """A live closed-loop sweep's figure at each multiple of HiCache's capacity, in order."""
    def read(result: dict) -> Any:
        pts = result.get("sweep") or []
        return ", ".join(f"{p['history_vs_capacity']:g}x {rounded(p[field_])}" for p in pts
                         if p.get(field_) is not None) or None
    return read


def _when(marker: str, path: str) -> Callable[[dict], Any]:
    """`path` read only from a result that holds `marker`: a key whose meaning depends on which
    run the record compared against (the upper bound, or the older ideal run before it)."""
    def read(result: dict) -> Any:
        return key(path)(result) if marker in result else None
    return read


# What each record's comparison run was. The upper bound: stock SGLang, no hierarchy, ONE device
# pool of the busy server's device, lent and host tokens. Records made before it compared against
# an older "ideal" run instead; its figures keep that name and are never called an upper bound.
UB = "upper bound (one stock pool of device + lent + host)"
OLD_TIERS_IDEAL = ("older ideal baseline (i) (HiCache with the lent memory as device memory, "
                   "not an upper bound)")
OLD_LOOP_IDEAL = "older ideal run (stock SGLang with the lent memory added to its device pool)"
NEWER, OLDER = "cached_vs_upper_bound", "cached_vs_ideal"  # which run a record compared with

NODE = "python scripts/bench_node.py --quick"
RECORDS: dict[str, RecordSpec] = {
    "demo": RecordSpec(
        "The demo: a donor and a borrower of another model shape, against stock SGLang",
        "demo (CPU)",
        "bash scripts/demo.sh", "README.md", {
            "conversations": "ShareGPT conversations replayed against the borrower",
            "turns": "turns per conversation asked for (at most; a conversation may have fewer)",
            "identical_outputs": "requests whose output text from the SwiftCache borrower equals "
                                 "stock SGLang's (same model, same KV pool)",
            "requests": "requests compared (every turn of every conversation)",
            "cached_tokens": "prompt tokens served from cache, summed over all requests: "
                             "[SwiftCache borrower, stock SGLang]",
            "cached_ratio": "SwiftCache's cached tokens / stock SGLang's",
            "ttft_sum_ratio": "summed TTFT of all requests, SwiftCache / stock (CPU engine, "
                              "small model: shows the mechanism, not GPU performance)",
        }, [Headline("identical outputs to stock", of("identical_outputs",
                                                                   "requests")),
            Headline("cached tokens / stock", key("cached_ratio"))]),
    "bench_node_quick": RecordSpec(
        "Node benchmark: stock SGLang (a), SwiftCache (b), capacity-equal ideal (c)",
        "node benchmark (CPU)",
        NODE, "docs/node_bench.md", {
            "identical": "every busy and donor output of (b) and (c) equals (a)'s, request by "
                         "request, in both phases",
            "busy_cached_ratio": "busy model's cached tokens in the steady phase, (b) / (a)",
            "busy_cached_vs_ideal": "busy model's cached tokens in the steady phase, (b) / (c)",
            "busy_ttft_p99_ratio": "TTFT P99 over the busy model's steady-phase requests, "
                                   "(b) / (a)",
            "busy_ttft_p99_vs_ideal": "the same P99, (b) / (c)",
            "donor_ttft_p99_ratio": "TTFT P99 over all donor requests (light ones and every "
                                    "round's burst), (b) / (a)",
            "reclaimed": "in (b) the donor had pages lent when each burst began, and its whole "
                         "pool was usable again before its next burst",
            "reclaim_latency_s": "(b)'s donor: mean seconds from a reclaim's demand to its last "
                                 "page back (its reclaim-latency histogram: sum / count)",
            "busy_cached_tokens": "busy model's cached tokens in the steady phase, per run",
            "busy_reclaim_cached_tokens": "busy model's cached tokens in its turns after the "
                                          "bursts, per run",
            "busy_reclaim_ttft_p99_ms": "busy model's TTFT P99 in its turns after the bursts, "
                                        "per run (ms)",
            "busy_ttft_p99_ms": "busy model's steady-phase TTFT P99, per run (ms)",
            "donor_ttft_p99_ms": "TTFT P99 over all donor requests, per run (ms)",
            "outputs_matched": "per run, outputs equal to (a)'s / outputs compared",
            "donor_burst_p99_ms": "TTFT P99 over the donor's burst requests, per run and for "
                                  "the twin t (ms)",
            "donor_ttft_p99_noise": "the twin's burst TTFT P99 / (a)'s: what two identical stock "
                                    "donors differ by on this machine (null without the twin)",
            "donor_burst_mean_ms": "mean TTFT over the donor's burst requests, per run and for "
                                   "the twin t (ms)",
            "donor_burst_mean_ratio": "mean burst TTFT, (b) / (a)",
            "donor_burst_mean_noise": "mean burst TTFT, twin / (a)",
            "donor_own_pages_wait_ms": "(b)'s donor: ms its scheduler waited for its lent pages "
                                       "to come back, per burst round",
            "reclaims": "(b)'s donor: reclaims completed in the run",
            "donor_full_after_burst_s": "(b)'s donor: seconds from a burst's start to the first "
                                        "sample showing its whole pool usable (slowest sampled "
                                        "round; samples once a second, so about 1 s slack)",
            "pools": "KV pool sizes (tokens) of the busy and donor servers, per run",
            "busy_flops_per_kv_byte": "prefill FLOPs per KV byte of the busy model (how much "
                                      "compute a cached byte saves)",
            "donor_flops_per_kv_byte": "the same for the donor model",
            "loadavg_1min": "per run, the machine's 1-minute load average before and after",
            "wall_s": "seconds the benchmark ran, start-ups included",
            "quick": "the --quick plan ran",
            "date": "the run's date (local)",
            "device": "what ran it",
            "donor_burst_split": "--diagnose only: each donor's bursts split into prefill "
                                 "passes and the time outside them, per round",
            "burst_cpu_ms": "--diagnose only: mean CPU ms of each server during a run's bursts",
        }, [Headline("identical to stock", key("identical")),
            Headline("busy cached tokens / stock", key("busy_cached_ratio")),
            Headline("busy cached tokens / ideal", key("busy_cached_vs_ideal")),
            Headline("busy TTFT P99 / stock", key("busy_ttft_p99_ratio"), readme=False),
            Headline("donor TTFT P99 / stock", key("donor_ttft_p99_ratio")),
            Headline("second stock donor / stock, burst P99 (noise floor)",
                     key("donor_ttft_p99_noise")),
            Headline("donor burst mean TTFT / stock", key("donor_burst_mean_ratio"),
                     readme=False)]),
    "chaos_quick": RecordSpec(
        "Chaos run: faults against live servers, every answer checked against stock SGLang",
        "chaos run (CPU)",
        "python scripts/chaos.py --quick", "docs/chaos.md", {
            "requests": "requests sent to the borrower",
            "answered": "requests the borrower answered",
            "wrong_tokens": "answers that differ from stock SGLang's answer to the same request",
            "hangs": "requests with no answer within --request-timeout-s",
            "errors": "HTTP errors (a 503 for a failed donor load is retried and counted in "
                      "load_503s instead)",
            "load_503s": "503 answers for a failed donor load (retried)",
            "faults": "faults injected and not aborted",
            "faults_by_kind": "the same, per kind of fault",
            "aborted_steps": "plan steps that could not run, with why",
            "faults_on_empty_tier": "faults that met a borrower with nothing in donor memory "
                                    "(they put no cached token at risk)",
            "lost_idle_tokens": "donor-tier tokens the borrower lost while every process was "
                                "alive",
            "lost_leases_while_alive": "leases the borrower lost in steps that killed no process",
            "borrower_counters": "the borrower's counters after the last step",
            "leases_seen": "distinct leases `ctl status` showed the borrower holding",
            "inconsistent": "counter checks that failed, with why (empty: all held)",
            "max_answer_s": "the borrower's slowest answer (s)",
            "stock_max_answer_s": "stock SGLang's slowest answer to the same requests (s): what "
                                  "the machine's load alone costs",
            "seconds": "seconds the run took",
            "load_avg": "load average at the start and at the end",
            "phases_s": "seconds spent starting servers and answering on stock, and running the "
                        "plan",
        }, [Headline("wrong tokens", key("wrong_tokens")),
            Headline("hangs", key("hangs")),
            Headline("tokens lost while alive", key("lost_idle_tokens"))]),
    "bench_context_quick": RecordSpec(
        "Layer stream cache: longest context at equal local KV memory",
        "layer stream cache (CPU)",
        "python scripts/bench_context.py --quick", "docs/layer_stream.md", {
            "max_context_stock": "longest context (tokens) stock SGLang served with outputs "
                                 "equal to the reference",
            "max_context_swiftcache": "the same for the layer-streamed server",
            "max_context_ratio": "max_context_swiftcache / max_context_stock",
            "identical": "every probe of both servers returned the reference's tokens",
            "decode_step_ratio": "decode step, streamed / resident (thread CPU time)",
            "prefill_token_ratio": "prefill per token, streamed / resident (thread CPU time)",
            "decode_step_ms_streamed": "median decode forward of the streamed server (CPU ms)",
            "decode_step_ms_resident": "median decode forward of the resident twin (CPU ms)",
            "prefill_ms_per_token_streamed": "streamed server's prefill CPU ms per token",
            "prefill_ms_per_token_resident": "resident twin's prefill CPU ms per token",
            "copy_ms_per_decode_step": "of the streamed decode step, ms spent on layer copies",
            "copy_ms_per_prefill_token": "of the streamed prefill, ms per token on layer copies",
            "local_kv_bytes_stock": "stock server's local KV bytes",
            "local_kv_bytes_swiftcache": "streamed server's local KV bytes (at most stock's)",
            "backing": "where the streamed layers live: host memory or a donor's pool",
            "quick": "the --quick setup ran",
            "store_pages_on_donor": "--backing donor: store pages placed on the donor",
            "rows_read_from_donor": "--backing donor: store rows read from donor memory",
            "donor_pool": "--backing donor: the donor's pool (tokens)",
            "resident_fraction": "--resident-fraction: share of local memory as resident rows",
            "resident_tokens": "--resident-fraction: resident slots (tokens)",
            "short_decode_step_ratio": "--resident-fraction: a request inside the resident "
                                       "slots, decode step streamed / resident",
            "short_rows_copied": "--resident-fraction: rows that request copied",
        }, [Headline("longest context / stock, equal local memory",
                     key("max_context_ratio")),
            Headline("identical", key("identical"))]),
    "bench_overlap_quick": RecordSpec(
        "Loads under the forward pass: scheduler stall, donor vs local hit vs recompute",
        "loads under the forward (CPU)",
        "python scripts/bench_overlap.py --quick", "docs/streaming.md", {
            "model": "the borrower's model",
            "flop_per_kv_byte": "its prefill FLOPs per KV byte",
            "prefix_tokens": "the prefix served as a miss, a local hit and a donor hit",
            "borrower_pool_tokens": "the borrower's KV pool (tokens)",
            "loads": "donor loads that completed, over all phases",
            "itl_donor_phase_loads": "requests with donor loads in the decode-ITL phase",
            "stall_ms_p50": "scheduler-thread wait on copies per load, P50 (ms)",
            "stall_ms_p99": "scheduler-thread wait on copies per load, P99 (ms)",
            "attention_wait_ms_p50": "per load, summed ms attention waited for its layers, P50",
            "attention_wait_ms_p99": "the same, P99",
            "ttft_ms": "median TTFT of the prefix as a miss, a local hit and a donor hit (ms)",
            "donor_vs_local_ttft": "median TTFT, donor hit / local hit",
            "donor_vs_recompute_ttft": "median TTFT, donor hit / miss (recompute)",
            "itl_ms_p99": "inter-token latency P99 of a decode while requests arrive, with local "
                          "hits and with donor hits (ms)",
            "decode_itl_p99_ratio": "that ITL P99, donor hits / local hits",
            "counters": "the borrower's swiftcache_* counters at the end",
            "timeline": "one load's per-layer timeline (ms): copy in place vs attention asks",
            "wall_s": "seconds the benchmark ran",
            "workdir": "where its logs went",
        }, [Headline("scheduler wait per load P99 (ms)", key("stall_ms_p99")),
            Headline("TTFT donor hit / local hit", key("donor_vs_local_ttft")),
            Headline("TTFT donor hit / recompute", key("donor_vs_recompute_ttft"))]),
    "simulate_quick": RecordSpec(
        "Simulator, paper setup, chat (SIMULATED: a model of a GPU node, not a measurement)",
        "simulator (**simulated**)",
        "python scripts/simulate.py --quick", "docs/simulation.md", {
            "simulated": "every figure of this record is simulated",
            "scenario": "the simulated node and workload",
            "slo": "the TTFT SLO and what counts as sustained",
            "comparisons": "SwiftCache against HiCache as the paper ran it (paper_setup) and "
                           "against HiCache with SwiftCache's cache memory (equal_fast_memory)",
            "comparisons.paper_setup.goodput_ratio_vs_hicache":
                "simulated SwiftCache goodput / HiCache's (highest session rate with P99 TTFT "
                "within the SLO and a queue that does not grow)",
            "comparisons.paper_setup.p99_ttft_reduction_at_stable":
                "simulated 1 - SwiftCache's P99 TTFT / HiCache's, both at the highest rate "
                "HiCache sustains",
            "comparisons.equal_fast_memory.goodput_ratio_vs_hicache":
                "the same goodput ratio against HiCache with equal fast memory (simulated)",
            "comparisons.equal_fast_memory.p99_ttft_reduction_at_stable":
                "the same reduction against HiCache with equal fast memory (simulated)",
            "max_context_ratio": "simulated maximum context of the busy model (Qwen3-32B), "
                                 "layer streaming from donor and host memory / stock SGLang "
                                 "(stepwise streaming model, scenario lend fraction; the "
                                 "leases and host add up, a design the live store does not "
                                 "run: see simulate_long_context_sweep)",
            "donor_load_share_of_own_goodput": "the donors' own traffic as a share of their "
                                               "goodput in the headline interference figure",
            "donor_interference": "simulated worst relative increase of a donor's P99 TTFT or "
                                  "P99 TPOT when it lends, at that share (0 when none rose)",
            "donor_interference_by_load_share": "the same, per share",
            "donor_p99_ttft_change_by_load_share": "simulated largest relative change of a "
                                                   "donor's P99 TTFT, per share",
            "donor_p99_tpot_change_by_load_share": "the same for P99 TPOT",
            "donor_interference_master_rate": "the busy model's session rate while the donors "
                                              "were measured",
        }, [Headline("simulated goodput / HiCache",
                     key("comparisons.paper_setup.goodput_ratio_vs_hicache")),
            Headline("simulated P99 TTFT reduction vs HiCache at its highest stable rate",
                     key("comparisons.paper_setup.p99_ttft_reduction_at_stable")),
            Headline("simulated donor interference",
                     key("donor_interference"))], simulated=True),
    "bench_tree_quick": RecordSpec(
        "radix_ext against SGLang's RadixCache on a ShareGPT trace",
        "radix tree (CPU)",
        "python scripts/bench_tree.py --quick", "docs/integration.md", {
            "us_per_request_ratio": "time in tree calls per replayed request, radix_ext / "
                                    "SGLang RadixCache (best of the repeats each; below 1: "
                                    "radix_ext is faster)",
            "sglang_us_per_request": "SGLang RadixCache: microseconds in tree calls per "
                                     "replayed request",
            "radix_ext_us_per_request": "radix_ext (donor tier on): the same, its load-backs "
                                        "of donor hits included",
            "scheduler_ops_per_s_ratio": "scheduler operations per second, radix_ext / SGLang, "
                                         "the same operations counted on both sides (8 per "
                                         "request and 1 per eviction)",
            "sglang_scheduler_ops_per_s": "SGLang RadixCache: scheduler operations per second",
            "radix_ext_scheduler_ops_per_s": "radix_ext: scheduler operations per second",
            "scheduler_ops": "scheduler operations counted, per side",
            "evictions": "eviction calls, per side",
            "radix_ext_uncounted": "radix_ext's load-backs and re-matches after an eviction: "
                                   "timed inside the scheduler's operations, not counted as "
                                   "operations (SGLang's side has neither)",
            "ratio": "older runs: radix_ext ops/s / SGLang's, radix_ext credited 2 operations "
                     "per load-back and 1 per re-match that SGLang's side never counts (part of "
                     "the ratio is that bookkeeping; superseded by us_per_request_ratio)",
            "sglang_ops_per_s": "older runs: SGLang RadixCache, tree operations per second",
            "radix_ext_ops_per_s": "older runs: radix_ext, tree operations per second with its "
                                   "load-backs and re-matches counted",
            "requests": "requests in the trace",
            "device_capacity": "device slots (tokens) both trees had",
            "sglang_hits": "SGLang: prompt tokens hit on the device, and reusable tokens missed",
            "radix_ext_hits": "radix_ext: prompt tokens hit on the device and in donor memory, "
                              "and reusable tokens missed",
            "reload_cost": "per donor size (x device), the reload cost of LRU and cost_aware "
                           "with a stable and a flaky donor (one token's recompute = 1)",
        }, [Headline("time per replayed request, radix_ext / SGLang",
                     key("us_per_request_ratio")),
            Headline("scheduler ops/s, radix_ext / SGLang, same operations counted",
                     key("scheduler_ops_per_s_ratio")),
            Headline("older runs: ops/s ratio with radix_ext's load-backs and re-matches "
                     "counted on its side only", key("ratio"), if_present=True)]),
    "bench_sched_overhead_quick": RecordSpec(
        "Time per scheduler step: SwiftCache against stock SGLang on one trace",
        "scheduler step (CPU)",
        "python scripts/bench_sched_overhead.py --quick", "benchmarks/sched_overhead.py", {
            "overhead_ratio_no_donation": "mean scheduler step time, SwiftCache without "
                                          "lending or borrowing / stock",
            "overhead_ratio_borrower": "the same, a borrower with donor hits / stock",
            "overhead_ratio_borrower_no_hits": "the same, a borrower without a lease (no hits) "
                                               "/ stock",
            "noise_ratio": "the same, a second stock run / stock: the noise floor",
            "outside_forward_ms": "per run, mean step time minus its forwards (ms)",
            "swift_work_per_step": "per SwiftCache run, its scheduler thread's time in "
                                   "SwiftCache's own code over the trace, ms per forward step "
                                   "by phase (match, insert, lock, evict, load_back, "
                                   "batch_start, batch_settle, loop), their total and the "
                                   "loops seen",
            "runs": "per run: steps timed, step time mean, P50, P99, outside the forward (ms)",
            "identical_to_stock": "per run, whether every output equals stock's",
            "busy_model": "the model, with its prefill FLOPs per KV byte",
            "trace": "conversations, turns, KV pool (tokens)",
            "loadavg": "per run, load average before and after",
            "wall_s": "seconds the benchmark ran",
        }, [Headline("step time, no donation / stock", key("overhead_ratio_no_donation")),
            Headline("step time, borrower with hits / stock", key("overhead_ratio_borrower")),
            Headline("stock twin / stock (noise floor)", key("noise_ratio")),
            Headline("SwiftCache's own work per step, borrower with hits (ms)",
                     key("swift_work_per_step.borrower_hits.total_ms"), readme=False)]),
    "bench_tiers_quick": RecordSpec(
        "The cache hierarchy: HiCache (h), HiCache with SwiftCache and a lending donor (s), the "
        "upper bound (u: stock SGLang, one device pool of device + lent + host tokens, no "
        "hierarchy; records made before it hold the older ideal baseline (i) instead, HiCache "
        "with the lent memory as device memory, not an upper bound), stock (r) and a HiCache "
        "twin (t)",
        "hierarchy, device/donor/host (CPU)",
        "python scripts/bench_tiers.py --quick", "docs/hierarchy.md", {
            "identical": "every busy output of (s) equals stock SGLang's (r), request by "
                         "request (greedy, token ids), over the requests compared (at least "
                         "one); records before `compared` counted a request empty in both as "
                         "a difference",
            "mismatches": "per run, compared busy outputs that differ from (r)'s (records "
                          "before `compared`: also those empty in both)",
            "compared": "per run, the busy requests it or (r) answered",
            "cached_tokens": "per run, the busy model's prompt tokens served from cache",
            "cached_vs_hicache": "busy cached tokens, (s) / (h)",
            "cached_vs_upper_bound": f"busy cached tokens, (s) / {UB} (u); at most 1 unless "
                                     "`upper_bound_exceeded` says why",
            "hicache_cached_vs_upper_bound": "busy cached tokens, (h) / (u)",
            "upper_bound_exceeded": "by how much and in which turns (s) cached more than (u), "
                                    "and why; absent where it did not",
            "upper_bound_pool_tokens": "(u)'s one device pool: the busy device pool, the lent "
                                       "and the host tokens",
            "empty_in_both": "per run, the busy requests neither it nor (r) answered (a "
                             "prompt longer than both pools allow): not compared",
            "cached_vs_ideal": f"older records: busy cached tokens, (s) / the {OLD_TIERS_IDEAL}",
            "ttft_p50_ms": "per run, the busy requests' TTFT P50 (ms)",
            "ttft_p99_ms": "per run, the busy requests' TTFT P99 (ms)",
            "ttft_p50_vs_hicache": "busy TTFT P50, (s) / (h)",
            "ttft_p99_vs_hicache": "busy TTFT P99, (s) / (h)",
            "ttft_p50_noise": "busy TTFT P50, twin (t) / (h): what two identical runs differ by",
            "ttft_p99_noise": "busy TTFT P99, twin (t) / (h)",
            "ttft_p50_vs_upper_bound": "busy TTFT P50, (s) / (u)",
            "ttft_p99_vs_upper_bound": "busy TTFT P99, (s) / (u)",
            "ttft_p99_upper_bound_vs_hicache": "busy TTFT P99, (u) / (h)",
            "ttft_p99_ideal_vs_hicache": "older records: busy TTFT P99, the older ideal baseline "
                                         "(i) / (h)",
            "hits_by_tier": "(s)'s busy cached tokens by the tier they came from",
            "recomputed_after_reclaim_tokens": "tokens in (s)'s donor tier when the burst "
                                               "reclaimed every lent page that a later request "
                                               "prefilled again",
            "rescued_tokens": "tokens the reclaim moved from donor pages into (s)'s host tier",
            "spilled_tokens": "tokens the reclaim wrote from donor pages straight to L3 when "
                              "(s)'s host tier had no room for them (with L3 only)",
            "donor_to_host_tokens": "tokens (s)'s evictions pushed out of the full lease "
                                    "and moved from donor pages into host",
            "donor_to_l3_tokens": "tokens (s)'s evictions pushed out of the full lease that no "
                                  "tier below took, written from donor pages to L3 (with L3 "
                                  "only)",
            "revoked_tokens": "cached tokens (s) lost to the reclaim",
            "reclaim_overflow_tokens": "tokens (s)'s tree held at the reclaim beyond what its "
                                       "device pool, host tier and remaining donor pages "
                                       "could hold without the lent pages: at least this many "
                                       "had to go (to L3, else dropped) under any placement",
            "reclaims": "reclaims (s)'s busy server acknowledged",
            "loads_failed": "(s)'s loads that failed (their requests would have been aborted)",
            "history_tokens": "the busy model's histories at the end (prompt + answer of each "
                              "conversation's last turn)",
            "device_plus_host_tokens": "the busy server's device pool plus host tier in (h)",
            "busy_model": "the busy model, with its prefill FLOPs per KV byte",
            "wall_s": "seconds each run took (servers' start included)",
            "loadavg": "per run, the load average before and after (1, 5, 15 min each)",
            "total_wall_s": "seconds the benchmark ran",
        }, [Headline("identical", key("identical")),
            Headline("cached tokens (s) / HiCache", key("cached_vs_hicache")),
            Headline(f"cached tokens (s) / {UB}", key("cached_vs_upper_bound"),
                     if_present=True),
            Headline(f"cached tokens (s) / {OLD_TIERS_IDEAL}", key("cached_vs_ideal"),
                     if_present=True),
            Headline("recomputed after the reclaim (tokens)",
                     key("recomputed_after_reclaim_tokens")),
            Headline("TTFT P99 (s) / HiCache", key("ttft_p99_vs_hicache")),
            Headline("twin / HiCache, TTFT P99 (noise floor)", key("ttft_p99_noise")),
            Headline(f"TTFT P99 (s) / {UB}", key("ttft_p99_vs_upper_bound"), readme=False,
                     if_present=True)]),
}

RECORDS["bench_tiers_quick"].keys.update({
    "cached_by_turn": "per run, the busy model's cached tokens turn by turn (the burst comes "
                      "after turn 3)",
    "relent_after_burst": "whether (s)'s donor lent again before the turns resumed after the "
                          "pause that follows the burst",
    "borrowed_at_end": "whether (s) held donor memory when the run ended"})
RECORDS["bench_tiers_l3_quick"] = replace(
    RECORDS["bench_tiers_quick"],
    title="The cache hierarchy with L3: every HiCache run of bench_tiers with SGLang's `file` "
          "storage backend below its host tier (write_back)",
    short="hierarchy with L3 file, device/donor/host/L3 (CPU)",
    command="python scripts/bench_tiers.py --quick --l3 file",
    keys={**RECORDS["bench_tiers_quick"].keys,
          "hits_by_tier": "(s)'s busy cached tokens by the tier they came from (l3: fetched "
                          "from the store into host, then loaded)"})
RECORDS["bench_node_quick_tp2"] = replace(
    RECORDS["bench_node_quick"],
    title="Node benchmark with a TP 2 busy model: every busy server (a, b, c) runs --tp 2, the "
          "donor --tp 1",
    short="node benchmark, busy --tp 2 (CPU)",
    command="python scripts/bench_node.py --quick --busy-tp 2",
    keys={**RECORDS["bench_node_quick"].keys,
          "busy_tp": "the busy servers' --tp (each rank one core; pools are per rank, in "
                     "tokens, as SGLang sizes them with --max-total-tokens)"})
RECORDS["bench_node_closed_loop"] = RecordSpec(
    "The node benchmark's closed loop: stock, SwiftCache, the upper bound (stock SGLang, one "
    "device pool of the busy pool, the loan and HiCache's host tokens, no hierarchy; records "
    "made before it hold the older ideal run instead, stock SGLang with the lent memory added to "
    "its device pool) and its twin under SGLang bench_multiturn's load (clients, rounds, request "
    "and output lengths, max parallel)",
    "closed loop, borrowed vs local memory (CPU)",
    "python scripts/bench_node.py --closed-loop", "docs/node_bench.md", {
        "identical": "every SwiftCache answer equals stock SGLang's, request by request",
        "mismatches": "per run, answers that differ from stock's",
        "cached_tokens": "per run, the busy model's prompt tokens served from cache",
        "cached_vs_upper_bound": f"cached tokens, SwiftCache / {UB}; at most 1 unless "
                                 "`upper_bound_exceeded` says why",
        "closed_loop_ttft_avg_vs_upper_bound": "mean TTFT, SwiftCache / upper bound",
        "closed_loop_ttft_p90_vs_upper_bound": "TTFT P90, SwiftCache / upper bound",
        "closed_loop_ttft_p99_vs_upper_bound": "TTFT P99, SwiftCache / upper bound",
        "stock_ttft_avg_vs_upper_bound": "mean TTFT, stock / upper bound",
        "stock_ttft_p99_vs_upper_bound": "TTFT P99, stock / upper bound",
        "upper_bound_pool": "the upper bound's one busy pool (tokens)",
        "upper_bound_exceeded": "by how much SwiftCache cached more than the upper bound, and "
                                "why; absent where it did not",
        "unlimited_cache_tokens": "cached tokens a cache that never evicts would serve on the "
                                  "same traffic (no size or eviction order serves more)",
        "cached_vs_unlimited_cache": "cached tokens, SwiftCache / that unlimited cache",
        "cached_vs_ideal": f"older records: cached tokens, SwiftCache / the {OLD_LOOP_IDEAL}",
        "closed_loop_ttft_avg_vs_ideal": "older records: mean TTFT, SwiftCache / older ideal "
                                         "run",
        "closed_loop_ttft_p90_vs_ideal": "older records: TTFT P90, SwiftCache / older ideal run",
        "closed_loop_ttft_p99_vs_ideal": "older records: TTFT P99, SwiftCache / older ideal run",
        "closed_loop_ttft_avg_noise": "mean TTFT, the comparison run's twin / it (the upper "
                                      "bound; in older records the older ideal run): the noise "
                                      "floor",
        "closed_loop_ttft_p99_noise": "TTFT P99, the same twin / it",
        "stock_ttft_avg_vs_ideal": "older records: mean TTFT, stock / older ideal run",
        "stock_ttft_p99_vs_ideal": "older records: TTFT P99, stock / older ideal run",
        "ttft_ms": "per run, TTFT mean, P50, P90, P99 (ms)",
        "history_vs_busy_pool": "the clients' histories at the end over the busy pool",
        "prompt_tokens": "prompt tokens of all requests (stock run)",
        "swift_stats": "the borrower's SwiftCache counters at the end",
        "swift_work_per_request": "the borrower's scheduler-thread time in SwiftCache's own "
                                  "code over the traffic, ms per request by phase (match, "
                                  "insert, lock, evict, load_back, batch_start, batch_settle, "
                                  "loop), their total and the loops seen",
        "pools": "per run, the busy and donor pools (tokens)",
        "load": "the closed loop's parameters",
        "wall_s": "per run, seconds of traffic",
        "loadavg": "per run, load average before and after (1, 5, 15 min)",
        "hicache_ratio": "HiCache's host tier in every run's busy server, as a multiple of the "
                         "base busy pool (0: no HiCache)",
    }, [Headline("identical", key("identical")),
        Headline(f"cached tokens / {UB}", key("cached_vs_upper_bound"), if_present=True),
        Headline("mean TTFT / upper bound", key("closed_loop_ttft_avg_vs_upper_bound"),
                 if_present=True),
        Headline("TTFT P99 / upper bound", key("closed_loop_ttft_p99_vs_upper_bound"),
                 if_present=True),
        Headline("upper bound twin / upper bound, mean TTFT (noise floor)",
                 _when(NEWER, "closed_loop_ttft_avg_noise"), if_present=True),
        Headline(f"cached tokens / {OLD_LOOP_IDEAL}", key("cached_vs_ideal"), if_present=True),
        Headline("mean TTFT / older ideal run", key("closed_loop_ttft_avg_vs_ideal"),
                 if_present=True),
        Headline("TTFT P99 / older ideal run", key("closed_loop_ttft_p99_vs_ideal"),
                 if_present=True),
        Headline("older ideal run's twin / it, mean TTFT (noise floor)",
                 _when(OLDER, "closed_loop_ttft_avg_noise"), if_present=True)])

def _multiturn_keys() -> dict[str, str]:
    keys = {}
    for n in ("8", "16", "32"):
        for pre, who in (("", "SwiftCache (donor tier)"),
                         ("stream_", "SwiftCache streaming from donor pages"),
                         ("mapped_", "SwiftCache reading donor pages in place (depth 0)")):
            keys[f"{n}.{pre}ttft_p99_vs_stock"] = (
                f"{n} clients: TTFT P99, {who} / stock at the same local KV memory; mean, "
                "worst and spread (max - min) over the seeds")
            keys[f"{n}.{pre}ttft_avg_vs_ideal"] = f"{n} clients: mean TTFT, {who} / ideal"
            keys[f"{n}.{pre}ttft_p99_vs_ideal"] = f"{n} clients: TTFT P99, {who} / ideal"
            keys[f"{n}.{pre}slowest_phase_p99"] = (
                f"{n} clients: {who}'s sequential phase with the largest P99 (mean over the "
                "seeds, and the worst seed beside stock's P99 of it)")
            keys[f"{n}.{pre}ttft_gap_split"] = (
                f"{n} clients: {who}'s mean TTFT minus the ideal's (ms, mean of seeds), split "
                "into what its uncached prompt tokens cost at the ideal's speed (the ideal's "
                "line of TTFT on uncached tokens), its longer wait for admission (queue) and "
                "the rest; in newer records also the part of the longer wait spent while "
                "another request ran (`queue_behind_running_ms`: behind the device room the "
                "requests in flight hold)")
        keys[f"{n}.twin_ttft_avg_vs_ideal"] = f"{n} clients: mean TTFT, ideal twin / ideal " \
                                              "(the noise floor)"
        keys[f"{n}.twin_ttft_p99_vs_ideal"] = f"{n} clients: TTFT P99, ideal twin / ideal"
    keys.update({
        "pools": "tokens: stock's and the donor-tier borrower's pool, its loan, the ideal's one "
                 "pool (pool + loan); the streaming server's pool, resident and streamed slots, "
                 "its donor's pool and the store pages placed on it; the depth-0 server's pool, "
                 "local and mapped rows, resident fraction, its donor's pool and the pieces "
                 "mapped onto it",
        "load": "bench_multiturn's options (clients and seed per point)",
        "wall_s": "seconds the benchmark ran",
        "quick": "whether it ran --quick (8 and 16 clients, seeds 1 and 2)",
        "device": "where it ran",
    })
    return keys


RECORDS["bench_multiturn_quick"] = RecordSpec(
    "SGLang bench_multiturn's traffic (random ready queue, Poisson arrivals, 2 requests in "
    "flight, 5 rounds, 64-token questions and answers): stock with a 1024-token pool, "
    "SwiftCache with the same pool and a donor tier, SwiftCache streaming layers from donor "
    "pages with the same local KV memory, SwiftCache reading donor pages in place (depth 0: "
    "the same local rows plus the loan), the ideal (one pool of the pool and the loan) and its "
    "twin; 8 and 16 clients, seeds 1 and 2",
    "bench_multiturn traffic, TTFT (CPU)",
    "python scripts/bench_multiturn.py --quick", "docs/node_bench.md", _multiturn_keys(),
    [Headline("16 clients, TTFT P99, donor pages read in place (depth 0, CPU only) / stock "
              "(mean of seeds)", key("16.mapped_ttft_p99_vs_stock.mean"), if_present=True),
     Headline("16 clients, mean TTFT, read in place / ideal (mean of seeds)",
              key("16.mapped_ttft_avg_vs_ideal.mean"), if_present=True),
     Headline("16 clients, TTFT P99, read in place / ideal (mean of seeds)",
              key("16.mapped_ttft_p99_vs_ideal.mean"), if_present=True),
     Headline("16 clients, TTFT P99, ideal twin / ideal (noise floor)",
              key("16.twin_ttft_p99_vs_ideal.mean"), readme=False),
     Headline("16 clients, TTFT P99, streaming from donor pages / stock (mean of seeds)",
              key("16.stream_ttft_p99_vs_stock.mean")),
     Headline("16 clients, mean TTFT, streaming / ideal (mean of seeds)",
              key("16.stream_ttft_avg_vs_ideal.mean")),
     Headline("16 clients, mean TTFT, ideal twin / ideal (noise floor)",
              key("16.twin_ttft_avg_vs_ideal.mean")),
     Headline("16 clients, TTFT P99, donor tier / stock (mean of seeds)",
              key("16.ttft_p99_vs_stock.mean"), readme=False),
     Headline("16 clients, streaming's mean TTFT minus the ideal's, ms (mean of seeds)",
              key("16.stream_ttft_gap_split.gap_ms"), readme=False, if_present=True),
     Headline("of which its uncached prompt tokens at the ideal's speed, ms",
              key("16.stream_ttft_gap_split.uncached_ms"), readme=False, if_present=True),
     Headline("16 clients, donor tier's mean TTFT minus the ideal's, ms: of which its wait for "
              "admission", key("16.ttft_gap_split.queue_ms"), readme=False, if_present=True)])

# headlines shared by the full record and the extra seeds: depth 0's ratios, then the twin's
# (the noise floor) and both spreads over the seeds
_DEPTH0 = (("TTFT P99, read in place / stock, worst seed", "mapped_ttft_p99_vs_stock.worst"),
           ("mean TTFT, read in place / ideal (mean of seeds)", "mapped_ttft_avg_vs_ideal.mean"),
           ("TTFT P99, read in place / ideal (mean of seeds)", "mapped_ttft_p99_vs_ideal.mean"))
_NOISE = (("mean TTFT, ideal twin / ideal (noise floor)", "twin_ttft_avg_vs_ideal.mean"),
          ("TTFT P99, ideal twin / ideal (noise floor)", "twin_ttft_p99_vs_ideal.mean"),
          ("mean TTFT / ideal, read in place: spread over the seeds (max - min)",
           "mapped_ttft_avg_vs_ideal.spread"),
          ("mean TTFT / ideal, ideal twin: spread over the seeds",
           "twin_ttft_avg_vs_ideal.spread"),
          ("TTFT P99 / ideal, read in place: spread over the seeds",
           "mapped_ttft_p99_vs_ideal.spread"),
          ("TTFT P99 / ideal, ideal twin: spread over the seeds",
           "twin_ttft_p99_vs_ideal.spread"))

RECORDS["bench_multiturn"] = replace(
    RECORDS["bench_multiturn_quick"],
    title=RECORDS["bench_multiturn_quick"].title.replace("8 and 16 clients, seeds 1 and 2",
                                                         "8, 16 and 32 clients, seeds 1 to 3"),
    short="bench_multiturn traffic, TTFT, 3 seeds (CPU)",
    command="python scripts/bench_multiturn.py",
    headlines=[Headline(f"{n} clients, {what}", key(f"{n}.{k}"), readme=False,
                        if_present=k.startswith("mapped_"))
               for n in ("8", "16", "32")
               for what, k in (*_DEPTH0,
                               ("TTFT P99, streaming / stock, worst seed",
                                "stream_ttft_p99_vs_stock.worst"),
                               ("mean TTFT, streaming / ideal (mean of seeds)",
                                "stream_ttft_avg_vs_ideal.mean"),
                               ("TTFT P99, streaming / ideal (mean of seeds)",
                                "stream_ttft_p99_vs_ideal.mean"),
                               *_NOISE)])


def _depth0_vs_twin(result: dict) -> dict:
    """Per client count, the depth-0 server's TTFT over the ideal twin's, seed by seed: both are
    ratios to the same ideal run of the same seed, so their quotient compares depth 0 with a copy
    of the ideal under the same draw of noise (records with each seed's ratios only)."""
    out = {}
    for n in ("8", "16", "32"):
        point = result.get(n) or {}
        pair = {}
        for what in ("avg", "p99"):
            ours = (point.get(f"mapped_ttft_{what}_vs_ideal") or {}).get("per_seed")
            twin = (point.get(f"twin_ttft_{what}_vs_ideal") or {}).get("per_seed")
            if ours and twin and len(ours) == len(twin):
                q = [a / b for a, b in zip(ours, twin)]
                pair[f"ttft_{what}"] = {"mean": sum(q) / len(q), "per_seed": q,
                                        "seeds_at_most_twin": sum(x <= 1.0 for x in q)}
        if pair:
            out[f"{n}_depth0_vs_twin"] = pair
    return out


def _more_seeds(n: str) -> RecordSpec:
    """Six more seeds (4 to 9) of one client count: stock, depth 0, the ideal and its twin."""
    return replace(
        RECORDS["bench_multiturn_quick"],
        title=f"SGLang bench_multiturn's traffic at {n} clients, seeds 4 to 9 (six more draws of "
              "a point where the full record's depth-0 server missed a target): stock with a "
              "1024-token pool, SwiftCache reading donor pages in place (depth 0), the ideal and "
              "its twin",
        short=f"bench_multiturn traffic, {n} clients, seeds 4-9 (CPU)",
        command=f"python scripts/bench_multiturn.py --clients {n} --seeds 4,5,6,7,8,9 "
                "--modes swiftcache_mapped",
        keys={**_multiturn_keys(),
              f"{n}_depth0_vs_twin": f"{n} clients: the depth-0 server's mean TTFT (`ttft_avg`) "
              "and TTFT P99 (`ttft_p99`) over the ideal twin's, seed by seed (`per_seed`; each "
              "is the quotient of the two ratios to the same ideal run), their mean and the "
              "number of seeds where depth 0 was no slower than the twin"},
        derive=_depth0_vs_twin,
        derived_note=f"`{n}_depth0_vs_twin` is computed from the record's `per_seed` ratios as "
                     "the page renders.",
        headlines=[Headline(f"{n} clients, TTFT P99, read in place / ideal twin, per seed "
                            "(mean)", key(f"{n}_depth0_vs_twin.ttft_p99.mean"), readme=False),
                   Headline(f"{n} clients, seeds where read in place's TTFT P99 <= the twin's",
                            key(f"{n}_depth0_vs_twin.ttft_p99.seeds_at_most_twin"),
                            readme=False),
                   Headline(f"{n} clients, mean TTFT, read in place / ideal twin, per seed "
                            "(mean)", key(f"{n}_depth0_vs_twin.ttft_avg.mean"), readme=False)] +
                  [Headline(f"{n} clients, {what}", key(f"{n}.{k}"), readme=False)
                   for what, k in (*_DEPTH0, *_NOISE)])


RECORDS["bench_multiturn_more_seeds"] = _more_seeds("16")
RECORDS["bench_multiturn_more_seeds_8"] = _more_seeds("8")

RECORDS["bench_multiturn_donor_tier_16"] = replace(
    RECORDS["bench_multiturn_quick"],
    title="SGLang bench_multiturn's traffic at 16 clients, seeds 4 to 6 (three more draws of a "
          "point where the full record's donor-tier borrower had a larger TTFT P99 than stock): "
          "stock with a 1024-token pool, SwiftCache with the same pool and a donor tier, the "
          "ideal and its twin",
    short="bench_multiturn traffic, donor tier, 16 clients, seeds 4-6 (CPU)",
    command="python scripts/bench_multiturn.py --clients 16 --seeds 4,5,6 --modes swiftcache",
    headlines=[Headline(f"16 clients, {what}", key(f"16.{k}"), readme=False)
               for what, k in (("TTFT P99, donor tier / stock, worst seed",
                                "ttft_p99_vs_stock.worst"),
                               ("TTFT P99, donor tier / stock (mean of seeds)",
                                "ttft_p99_vs_stock.mean"),
                               ("mean TTFT, donor tier / ideal (mean of seeds)",
                                "ttft_avg_vs_ideal.mean"),
                               ("donor tier's mean TTFT minus the ideal's, ms (mean of seeds)",
                                "ttft_gap_split.gap_ms"),
                               ("of which its longer wait for admission, ms",
                                "ttft_gap_split.queue_ms"),
                               ("of which while another request ran, ms",
                                "ttft_gap_split.queue_behind_running_ms"),
                               *_NOISE[:2])])

RECORDS["bench_node_closed_loop_sweep"] = RecordSpec(
    "The closed loop swept over client counts: HiCache, HiCache + SwiftCache, the upper bound "
    "(older records: the older ideal run) and a HiCache twin at each, the clients' histories "
    "from half to four times HiCache's device pool plus host tier",
    "closed loop by multiple of HiCache's capacity (CPU)",
    "python scripts/bench_node.py --closed-loop --busy-pool 512 --hicache-ratio 2 "
    "--sweep-clients 3,6,12,24", "docs/node_bench.md", {
        "sweep": "one entry per client count (the keys below)",
        "sweep.clients": "closed-loop clients",
        "sweep.history_vs_capacity": "the clients' histories at the end over the busy server's "
                                     "device pool plus host tier (HiCache's capacity)",
        "sweep.cached_tokens": "per system, the busy model's prompt tokens served from cache",
        "sweep.cached_vs_stock": "cached tokens, SwiftCache / HiCache",
        "sweep.cached_vs_upper_bound": f"cached tokens, SwiftCache / {UB} (newer records)",
        "sweep.upper_bound_exceeded": "SwiftCache above the upper bound: by how much, and why",
        "sweep.cached_vs_unlimited_cache": "cached tokens, SwiftCache / a cache that never "
                                           "evicts (newer records)",
        "sweep.ttft_avg_ms": "per system, mean TTFT (ms)",
        "sweep.ttft_p99_ms": "per system, TTFT P99 (ms)",
        "sweep.ttft_p99_reduction_vs_stock": "1 - SwiftCache's TTFT P99 / HiCache's",
        "sweep.ttft_p99_twin_vs_stock": "TTFT P99, HiCache twin / HiCache: the noise floor",
        "sweep.ttft_avg_twin_vs_stock": "mean TTFT, HiCache twin / HiCache",
        "sweep.mismatches": "per system, answers that differ from HiCache's",
        "sweep.loadavg": "per system, load average before and after",
        "identical": "every SwiftCache answer equals HiCache's at every point",
        "hicache_ratio": "HiCache's host tier, a multiple of the busy pool",
        "capacity_tokens": "the busy server's device pool plus host tier (tokens)",
        "load": "the closed loop's parameters (clients: the base, swept)",
    }, [Headline("identical", key("identical")),
        Headline("TTFT P99 reduction vs HiCache by multiple",
                 _sweep_curve("ttft_p99_reduction_vs_stock")),
        Headline("HiCache twin / HiCache, TTFT P99, by multiple (noise floor)",
                 _sweep_curve("ttft_p99_twin_vs_stock")),
        Headline("cached tokens / HiCache by multiple", _sweep_curve("cached_vs_stock")),
        Headline("cached tokens / upper bound by multiple",
                 _sweep_curve("cached_vs_upper_bound"), if_present=True)])
RECORDS["bench_tiers_l3_wt_quick"] = replace(
    RECORDS["bench_tiers_l3_quick"],
    title="The cache hierarchy with L3 under HiCache's default write policy: every HiCache run "
          "of bench_tiers write_through, with SGLang's `file` storage backend below its host tier",
    short="hierarchy with L3 file, write_through (CPU)",
    command="python scripts/bench_tiers.py --quick --l3 file --write-policy write_through")
RECORDS["simulate_validate_tiers"] = RecordSpec(
    "The simulator against a live bench_tiers run: stock, HiCache, HiCache + SwiftCache and the "
    "upper bound (records made before it: the older ideal baseline (i)) simulated with this "
    "CPU's measured costs and bench_tiers' own prompts, beside the live records",
    "simulated vs live, hierarchy (CPU)",
    'bash -c "python scripts/bench_tiers.py --quick && python scripts/calibrate_cpu.py --bench '
    'tiers && python scripts/simulate.py --validate --tiers"', "docs/simulation.md", {
        "simulated_vs_live": "the record compares simulated figures with measured ones",
        "bench": "which benchmark's runs were simulated",
        "validation": "the figures the simulator does not share with the live code, each live, "
                      "simulated and its error abs(simulated - live) / live: HiCache's cached "
                      "tokens, every run's TTFT P50 and P99, (s)'s hits by tier",
        "within_20pct": "per validation figure, its error within 20% (TTFT P99 included); "
                        "records made before the validation figures held per target run, "
                        "cached tokens and TTFT P50 within 20%: the page shows it re-derived",
        "all_within_20pct": "every validation figure within 20%",
        "largest_error": "the validation figure furthest from live, and its error",
        "consistency_check": "not validation: the cached tokens of (r), (s) and (u) (older "
                             "records: (i)), live and simulated, from the same radix_ext code "
                             "replaying the same trace (equal expected)",
        "cached_tokens_error": "older runs: abs(simulated - live) / live busy cached tokens, mean "
                               "of (h) and (s) ((s)'s half is the consistency check, not "
                               "validation)",
        "ttft_p50_error": "older runs: the same for the busy requests' TTFT P50",
        "ttft_p99_error": "older runs: the same for TTFT P99",
        "per_run": "older runs: the three errors per run (stock, hicache, hicache+swiftcache, "
                   "ideal: the older baseline (i)), consistency and validation figures "
                   "mixed",
        "per_run.stock": "(r)'s errors: cached tokens, TTFT P50, TTFT P99",
        "per_run.hicache": "(h)'s errors",
        "per_run.hicache+swiftcache": "(s)'s errors",
        "per_run.ideal": f"(i)'s errors: the {OLD_TIERS_IDEAL}",
        "figures": "per run, live and simulated cached tokens, TTFT P50 and P99 (ms)",
        "hits_by_tier": "(s)'s cached tokens by tier, live (metrics) and simulated",
        "rescued_tokens": "tokens (s)'s reclaim moved from donor pages into host, live and "
                          "simulated",
        "live": "the live bench_tiers record file",
        "calibration": "the calibration JSON",
        "calibration_date": "when the calibration ran",
        "trace_matches_live": "every busy request of every run is alike live and simulated: "
                              "served or refused as live, and if served, with the live prompt "
                              "and answer tokens",
        "refused_requests": "per run, busy prompts the server refused as longer than its pool "
                            "allows, live and simulated",
        "upper_bound_pool_tokens": "(u)'s one pool, live and simulated, and whether they agree",
    }, [Headline("validation figures within 20% of live, TTFT P99 included",
                 lambda r: _count_true(r.get("within_20pct"))),
        Headline("largest validation error", lambda r: _largest(r.get("largest_error"))),
        Headline("consistency check, not validation: cached tokens equal live, same code",
                 lambda r: _count_true({k: v["equal"] for k, v in
                                        (r.get("consistency_check") or {}).items()}))],
    derive=lambda result: _validation_figures().from_result(result),
    table=lambda result: _validation_figures().format_table(result).splitlines(),
    derived_note="`validation`, `within_20pct`, `all_within_20pct`, `largest_error` and "
                 "`consistency_check` are computed from the record's `figures` and "
                 "`hits_by_tier` as the page renders "
                 "(`benchmarks/simulator/validation_figures.py`), so a record made before "
                 "them reads as one made now.")


def _count_true(flags: dict | None) -> Any:
    return None if not flags else f"{sum(map(bool, flags.values()))}/{len(flags)}"


def _largest(worst: dict | None) -> Any:
    return None if not worst or worst.get("error") is None else \
        f"{worst['error']} ({worst['figure']})"


@functools.cache
def _validation_figures():
    """benchmarks/simulator/validation_figures.py, loaded alone (no simulator import)."""
    path = ROOT / "benchmarks" / "simulator" / "validation_figures.py"
    spec = importlib.util.spec_from_file_location("validation_figures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

# ---- simulated records: the long-context sweep, the closed loop, the regime grid ----------------
RECORDS["simulate_quick"].keys.update({
    "capacity_regime": "the cell docs/simulation.md section 9.1 chose before the grid ran as "
                       "realistic for the paper's node (regime.REALISTIC), one seed, idle donors "
                       "(simulated)",
    "capacity_regime.cell": "that cell: workload/think time/minimum turns/host GB/PCIe GB/s",
    "capacity_regime.goodput_ratio_vs_hicache": "simulated SwiftCache goodput / HiCache's there",
    "capacity_regime.p99_ttft_reduction_at_80pct": "simulated 1 - SwiftCache's P99 TTFT / "
                                                   "HiCache's, both at 80% of HiCache's goodput",
})
RECORDS["simulate_quick"].headlines.append(
    Headline("simulated goodput / HiCache, capacity regime (chosen cell)",
             key("capacity_regime.goodput_ratio_vs_hicache")))


def _best_row(only: str | None = None) -> Callable[[dict], Any]:
    """The sweep row with the longest context (of one backing, or of all)."""
    def read(result: dict) -> Any:
        rows = [r for r in result.get("rows", []) if r.get("ratio") is not None
                and (only is None or r["backing"] == only)]
        if not rows:
            return None
        r = max(rows, key=lambda r: r["ratio"])
        return (f"{r['ratio']}x ({r['backing']}, lend {r['lend_fraction']}, host "
                f"{r['host_gb']:g} GB, resident {r['resident_fraction']}); decode step "
                f"{r['decode_step_ms']} ms vs {r['decode_step_resident_ms']} ms resident")
    return read


def _closed_loop(field_: str, system: str, at: int = -1) -> Callable[[dict], Any]:
    """A closed-loop point's figure for one system (default: the largest multiple)."""
    def read(result: dict) -> Any:
        pts = result.get("points") or []
        if not pts:
            return None
        p = pts[at]
        return f"{p[field_][system]} at {p['multiple']:g}x ({p['clients']} clients)"
    return read


def _closed_loop_curve(field_: str, system: str) -> Callable[[dict], Any]:
    """A figure at every multiple of HiCache's capacity, in order."""
    def read(result: dict) -> Any:
        pts = result.get("points") or []
        return ", ".join(f"{p['multiple']:g}x {p[field_][system]}" for p in pts) or None
    return read


def _grid_cell(cell: str | None, stat: str) -> Callable[[dict], Any]:
    """A grid cell's statistic (median [min, max] over seeds); None: the realistic cell."""
    def read(result: dict) -> Any:
        c = (result.get("cells") or {}).get(cell or result.get("realistic_cell") or "")
        return None if c is None else _stat(c.get(stat))
    return read


def _grid_best(result: dict) -> Any:
    cells = result.get("cells") or {}
    scored = [(c["goodput_ratio_vs_hicache"]["median"], k) for k, c in cells.items()
              if c.get("goodput_ratio_vs_hicache")]
    if not scored:
        return None
    ratio, cell = max(scored)
    return f"{ratio} ({cell})"


def _grid_count(threshold: float) -> Callable[[dict], Any]:
    def read(result: dict) -> Any:
        cells = (result.get("cells") or {}).values()
        got = [c["goodput_ratio_vs_hicache"]["median"] for c in cells
               if c.get("goodput_ratio_vs_hicache")]
        return f"{sum(x >= threshold for x in got)}/{len(got)}" if got else None
    return read


def _stat(s: Any) -> Any:
    if not isinstance(s, dict):
        return s
    if s["min"] == s["max"]:
        return s["median"]
    return f"{s['median']} [{s['min']}, {s['max']}]"


RECORDS["simulate_long_context_sweep"] = RecordSpec(
    "Simulator, long context swept: lend fraction x host memory x resident rows x backing, idle "
    "donors (SIMULATED)",
    "long context, swept (**simulated**)",
    "python scripts/simulate.py --long-context-sweep", "docs/simulation.md", {
        "simulated": "every figure of this record is simulated",
        "mode": "which experiment ran",
        "model": "the long-context model (the paper's LWM-Text-1M)",
        "gpu": "its GPU (the paper's H20)",
        "depth": "staging layers kept local per request (the live stream's prefetch depth)",
        "stock_max_tokens": "stock SGLang's longest context: the request's KV in the local pool",
        "window_tokens": "the model's context window (tokens)",
        "rows": "per configuration: backing (host (live): every row in host memory, the "
                "leases holding copies, as the live store; donor + host (additive): the leases "
                "and host add up, not built), lend fraction, lease GB, host GB, resident "
                "fraction, longest context, its ratio to stock (null: nothing can stream), the "
                "decode step there streamed and resident (ms) and their ratio",
        "paper_ratio": "the paper's maximum-context gain (abstract)",
        "reaches_paper_ratio": "the configurations whose ratio is at least the paper's, with "
                               "the decode step there",
    }, [Headline("simulated longest context / stock, best configuration", _best_row()),
        Headline("the same, the live (host-backed) store", _best_row("host (live)"))],
    simulated=True)
RECORDS["simulate_closed_loop"] = RecordSpec(
    "Simulator, closed loop as SGLang's bench_multiturn.py: HiCache, HiCache + SwiftCache and the "
    "ideal at multiples of HiCache's capacity (SIMULATED)",
    "closed loop (**simulated**)",
    "python scripts/simulate.py --closed-loop", "docs/simulation.md", {
        "simulated": "every figure of this record is simulated",
        "mode": "which experiment ran",
        "capacity_clients": "clients whose final histories together fill HiCache's device pool "
                            "plus host tier (1x)",
        "points": "per multiple of that capacity: clients, each system's P99 TTFT (s) and cached "
                  "tokens (medians over the seeds), P99 TTFT reduction and cached tokens against "
                  "HiCache, hits by tier (first seed)",
        "params": "the closed loop's parameters (rounds, request and output length, max "
                  "parallel, request rate, ready-queue policy, seeds, host GB, PCIe GB/s)",
    }, [Headline("simulated P99 TTFT reduction vs HiCache by multiple of its capacity",
                 _closed_loop_curve("p99_ttft_reduction_vs_hicache", "swiftcache")),
        Headline("simulated P99 TTFT reduction vs HiCache, largest multiple",
                 _closed_loop("p99_ttft_reduction_vs_hicache", "swiftcache"), readme=False),
        Headline("simulated cached tokens / HiCache, largest multiple",
                 _closed_loop("cached_vs_hicache", "swiftcache"))], simulated=True)
_GRID_KEYS = {
    "simulated": "every figure of this record is simulated",
    "mode": "which experiment ran",
    "seeds": "the traffic seeds run for every cell",
    "window_s": "seconds of session arrivals per run",
    "refine_steps": "bisections of each goodput after its bracket",
    "write_policy": "HiCache's write policy in every system with a host tier",
    "donors": "the donors' state (idle: the lease whole, never reclaimed)",
    "realistic_cell": "the cell chosen before the grid ran as realistic (null: not in this run)",
    "cells": "per cell, medians [min, max] over the seeds: goodput ratios (SwiftCache and the "
             "ideal against HiCache), HiCache's goodput, P99 TTFT reductions at 50/80/95% of "
             "HiCache's goodput, hits by tier at 80%, peak live KV against device + host, and "
             "the memory of each system (the table below)",
}
for _pcie in (32, 8, 16):  # one record per PCIe bandwidth: each fits in about half an hour
    RECORDS[f"simulate_grid_pcie{_pcie}"] = RecordSpec(
        f"Simulator, regime grid at PCIe {_pcie} GB/s, every other knob's every value, seeds "
        "0, 1, 2 (SIMULATED)",
        f"regime grid, PCIe {_pcie} GB/s, 3 seeds (**simulated**)",
        f"python scripts/simulate.py --grid --seeds 0,1,2 --pcie-gbps {_pcie}",
        "docs/simulation.md",
        dict(_GRID_KEYS),
        [Headline("simulated goodput / HiCache, best cell", _grid_best),
         Headline("cells with simulated goodput / HiCache >= 1.1", _grid_count(1.1))],
        simulated=True)
RECORDS["simulate_grid_seeds"] = RecordSpec(
    "Simulator, regime grid, the cells the prediction calls decisive at three seeds (SIMULATED)",
    "regime grid, decisive cells, 3 seeds (**simulated**)",
    "python scripts/simulate.py --grid --workloads chat --think-s 60,300 --min-turns 4 "
    "--host-gb 32.6,65,100 --pcie-gbps 32 --seeds 0,1,2", "docs/simulation.md",
    dict(_GRID_KEYS),
    [Headline("simulated goodput / HiCache, realistic cell", _grid_cell(None,
                                                                      "goodput_ratio_vs_hicache")),
     Headline("simulated P99 TTFT reduction at 80% of HiCache's goodput, realistic cell",
              _grid_cell(None, "p99_ttft_reduction_at_80pct"))], simulated=True)
# a cell is shown from the first of these holding it
GRID_RECORDS = ("simulate_grid_seeds", "simulate_grid_pcie32", "simulate_grid_pcie8",
                "simulate_grid_pcie16")

# ---- whether a record ran on the product as it is now -------------------------------------------
@functools.cache
def _record_run():
    """scripts/record_run.py, which defines the product tree a record carries."""
    spec = importlib.util.spec_from_file_location("record_run",
                                                  Path(__file__).with_name("record_run.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Freshness:
    """A record's product tree against the product tree now."""

    ran_on: str | None  # the product tree the record ran on (None: cannot tell)
    now: str | None  # the product tree compared with
    uncommitted: bool  # the command ran with uncommitted changes in the tree
    exact: bool  # ran_on was taken from the tree that ran, not from the commit the record names

    @property
    def stale(self) -> bool | None:
        if self.ran_on is None or self.now is None:
            return None
        return self.ran_on != self.now

    @property
    def current(self) -> bool:
        """Provably run on this product: same tree, and that tree is known exactly."""
        return self.stale is False and (self.exact or not self.uncommitted)

    def mark(self) -> str:
        base = {None: "unknown", True: "**stale**", False: "current"}[self.stale]
        return base + (", uncommitted tree" if self.uncommitted else "")


def freshness(rec: dict, now: str | None, root: Path) -> Freshness:
    exact = rec.get("product_tree") is not None
    ran_on = rec["product_tree"] if exact else _record_run().product_tree(rec.get("commit"), root)
    return Freshness(ran_on, now, bool(rec.get("uncommitted_changes")), exact)


def mark(rec: dict | None) -> str:
    return rec["_freshness"].mark() if rec and "_freshness" in rec else "unknown"


# ---- reading -----------------------------------------------------------------------------------
def load_records(records_dir: Path, now: str | None = None, root: Path | None = None
                 ) -> dict[str, dict]:
    """Every record of RECORDS that exists, each with its Freshness against `now` (a product
    tree) under the private key `_freshness`."""
    out = {}
    for name in RECORDS:
        path = records_dir / f"{name}.json"
        if path.exists():
            rec = json.loads(path.read_text())
            if RECORDS[name].derive is not None:
                rec["result"] = {**rec["result"], **RECORDS[name].derive(rec["result"])}
            rec["_freshness"] = freshness(rec, now, root or records_dir.parents[1])
            out[name] = rec
    return out


def rounded(value: Any) -> Any:
    """Floats to 4 significant digits (a record keeps every digit; a page shows what it means)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def fmt(value: Any) -> str:
    if value is None:
        return "absent"
    text = value if isinstance(value, str) else json.dumps(rounded(value), sort_keys=False)
    if len(text) > LONG_VALUE:
        return f"(in the record, {len(text)} characters)"
    return text


def cite(name: str, rec: dict) -> str:
    dirty = ", with uncommitted changes" if rec.get("uncommitted_changes") else ""
    m, f = rec.get("machine", {}), rec.get("_freshness")
    product = f"; product tree {f.ran_on or 'unknown'}: {f.mark()}" if f else ""
    return (f"[`docs/records/{name}.json`](records/{name}.json), {rec['started_utc']} UTC, "
            f"commit {rec['commit']}{dirty}{product}; `{rec['command']}`; {m.get('cpus')} CPUs; "
            f"load average {rec['load_average_before'][0]} before, "
            f"{rec['load_average_after'][0]} after; {rec['wall_s']} s")


# ---- the regime grid's table and the comparison table ------------------------------------------
def grid_rows(records: dict[str, dict], link_prefix: str) -> list[str]:
    """Every cell of the grid records, each from the first record in GRID_RECORDS holding it."""
    rows = ["| cell | seeds | HiCache goodput (sessions/s) | SwiftCache / HiCache goodput | "
            "ideal / HiCache | SwiftCache's P99 TTFT reduction at 50% / 80% / 95% of HiCache's "
            "goodput | hits at 80%: HiCache; SwiftCache | peak live KV / device + host | "
            "predicted rate filling device + host (sessions/s) | record |", "|" + "---|" * 10]
    seen: set[str] = set()
    for name in GRID_RECORDS:
        rec = records.get(name)
        if rec is None:
            rows.append(f"| {NOT_RECORDED}: `{name}` |" + " |" * 9)
            continue
        for cell, c in rec["result"]["cells"].items():
            if cell in seen:
                continue
            seen.add(cell)
            red = " / ".join(str(_stat(c[f"p99_ttft_reduction_at_{p}pct"]))
                             for p in (50, 80, 95))
            hits = "; ".join(", ".join(f"{t} {v:.2f}" for t, v in
                                       c["hits_by_tier_at_80pct"].get(s, {}).items())
                             for s in ("sglang-hicache", "swiftcache"))
            rows.append(f"| {cell} | {','.join(map(str, c['seeds']))} | "
                        f"{_stat(c['hicache_goodput'])} | "
                        f"{_stat(c['goodput_ratio_vs_hicache'])} | "
                        f"{_stat(c['ideal_goodput_ratio_vs_hicache'])} | {red} | {hits} | "
                        f"{c['peak_live_over_device_plus_host']} | "
                        f"{c['rate_filling_device_plus_host']} | "
                        f"[{name}]({link_prefix}{name}.json) |")
    return rows


@dataclass(frozen=True)
class Figure:
    """One figure of the comparison table: read from a record's result."""

    record: str
    label: str
    read: Callable[[dict], Any]
    if_present: bool = False  # left out where the record lacks it (one kind of record only)


# The columns, each with the mechanism it tests.
COMPARISON_COLUMNS = (
    ("paper", "4 x H20, Qwen3 models, ShareGPT multi-turn, LWM-Text-1M (arXiv 2606.16135; "
              "only the abstract is public)"),
    ("simulated, compute regime", "the busy model's live KV fits device + host: only load "
                                  "speed (NVLink against PCIe) can differ"),
    ("simulated, capacity regime", "the live KV nears or outgrows device + host: donor pages as "
                                   "added capacity; for context, layer streaming"),
    ("simulated, overloaded", "a closed loop whose histories exceed HiCache's device + host "
                              "several times over"),
    ("live CPU", "real SGLang servers on the CPU engine, small models: what is cached and that "
                 "outputs stay identical, not GPU speed"),
    ("GPU", "SwiftCache has not run on a GPU"),
)
NONE_RAN = "none ran"
_CR = "comparisons.paper_setup."
COMPARISON: list[tuple[str, str, dict[str, list]]] = [
    ("P99 TTFT against HiCache", "down by up to 69%", {
        "simulated, compute regime": [
            Figure("simulate_quick", "reduction at HiCache's goodput",
                   key(_CR + "p99_ttft_reduction_at_stable")),
            Figure("simulate_grid_pcie32", "reduction at 95% of HiCache's goodput, "
                                    "chat/think10/turns1/host32.6/pcie32",
                   _grid_cell("chat/think10/turns1/host32.6/pcie32",
                              "p99_ttft_reduction_at_95pct"))],
        "simulated, capacity regime": [
            Figure("simulate_quick", "reduction at 80% of HiCache's goodput, chosen cell",
                   key("capacity_regime.p99_ttft_reduction_at_80pct")),
            Figure("simulate_grid_seeds", "the same cell at 95%, median [min, max] of 3 seeds",
                   _grid_cell(None, "p99_ttft_reduction_at_95pct"))],
        "simulated, overloaded": [
            Figure("simulate_closed_loop", "reduction by multiple of HiCache's capacity",
                   _closed_loop_curve("p99_ttft_reduction_vs_hicache", "swiftcache"))],
        "live CPU": [
            Figure("bench_tiers_quick", "P99 TTFT, SwiftCache / HiCache",
                   key("ttft_p99_vs_hicache")),
            Figure("bench_tiers_quick", "HiCache twin / HiCache (noise floor)",
                   key("ttft_p99_noise")),
            Figure("bench_node_closed_loop_sweep", "closed loop, reduction by multiple of "
                   "HiCache's capacity", _sweep_curve("ttft_p99_reduction_vs_stock")),
            Figure("bench_node_closed_loop_sweep", "HiCache twin / HiCache by multiple (noise "
                   "floor)", _sweep_curve("ttft_p99_twin_vs_stock"))]}),
    ("goodput against HiCache", "not stated", {
        "simulated, compute regime": [
            Figure("simulate_quick", "SwiftCache / HiCache",
                   key(_CR + "goodput_ratio_vs_hicache"))],
        "simulated, capacity regime": [
            Figure("simulate_quick", "SwiftCache / HiCache, chosen cell",
                   key("capacity_regime.goodput_ratio_vs_hicache")),
            Figure("simulate_grid_seeds", "the same cell, 3 seeds",
                   _grid_cell(None, "goodput_ratio_vs_hicache")),
            Figure("simulate_grid_pcie32", "best cell at PCIe 32 GB/s", _grid_best),
            Figure("simulate_grid_pcie8", "best cell at PCIe 8 GB/s", _grid_best)],
        "simulated, overloaded": ["a closed loop has no arrival rate"],
        "live CPU": ["not measured (a goodput search needs many runs per point)"]}),
    ("cached tokens against HiCache or stock", "90.7% prefix hits, ShareGPT multi-turn "
                                               "(from notes on the body)", {
        "simulated, capacity regime": [
            Figure("simulate_quick", "hits by tier at 80% of HiCache's goodput, chosen cell",
                   key("capacity_regime.hits_by_tier_at_80pct"))],
        "simulated, overloaded": [
            Figure("simulate_closed_loop", "SwiftCache / HiCache by multiple",
                   _closed_loop_curve("cached_vs_hicache", "swiftcache"))],
        "live CPU": [
            Figure("bench_tiers_quick", "SwiftCache / HiCache", key("cached_vs_hicache")),
            Figure("bench_node_quick", "SwiftCache / stock", key("busy_cached_ratio")),
            Figure("bench_node_closed_loop_sweep", "closed loop, SwiftCache / HiCache by "
                   "multiple", _sweep_curve("cached_vs_stock"))]}),
    (f"against an {UB}: no placement of the same memory caches more (under SGLang's LRU)",
     "not stated", {
        "live CPU": [
            Figure("bench_tiers_quick", "cached tokens, SwiftCache / upper bound",
                   key("cached_vs_upper_bound"), if_present=True),
            Figure("bench_tiers_quick", "TTFT P99, SwiftCache / upper bound",
                   key("ttft_p99_vs_upper_bound"), if_present=True),
            Figure("bench_node_closed_loop", "closed loop, cached tokens, SwiftCache / upper "
                   "bound", key("cached_vs_upper_bound"), if_present=True),
            Figure("bench_node_closed_loop", "closed loop, TTFT P99, SwiftCache / upper bound",
                   key("closed_loop_ttft_p99_vs_upper_bound"), if_present=True),
            Figure("bench_node_closed_loop", "upper bound twin / upper bound (noise floor)",
                   _when(NEWER, "closed_loop_ttft_p99_noise"), if_present=True)]}),
    ("against the ideal (the lent memory as the busy model's own device memory)", "not stated", {
        "simulated, capacity regime": [
            Figure("simulate_grid_seeds", "ideal goodput / HiCache, chosen cell, 3 seeds",
                   _grid_cell(None, "ideal_goodput_ratio_vs_hicache"))],
        "simulated, overloaded": [
            Figure("simulate_closed_loop", "the ideal's P99 TTFT reduction vs HiCache by multiple",
                   _closed_loop_curve("p99_ttft_reduction_vs_hicache", "ideal"))],
        "live CPU": [
            Figure("bench_tiers_quick", f"cached tokens, SwiftCache / {OLD_TIERS_IDEAL}",
                   key("cached_vs_ideal"), if_present=True),
            Figure("bench_node_closed_loop", f"closed loop, cached tokens, SwiftCache / "
                   f"{OLD_LOOP_IDEAL}", key("cached_vs_ideal"), if_present=True),
            Figure("bench_node_closed_loop", "closed loop, TTFT P99, SwiftCache / older ideal "
                   "run", key("closed_loop_ttft_p99_vs_ideal"), if_present=True),
            Figure("bench_node_closed_loop", "older ideal run's twin / it (noise floor)",
                   _when(OLDER, "closed_loop_ttft_p99_noise"), if_present=True)]}),
    ("longest context", "up to 3.98x", {
        "simulated, capacity regime": [
            Figure("simulate_long_context_sweep", "LWM-Text-1M, best configuration",
                   _best_row()),
            Figure("simulate_long_context_sweep", "the live (host-backed) store",
                   _best_row("host (live)")),
            Figure("simulate_quick", "Qwen3-32B, donor + host (additive), the scenario's lend "
                                     "fraction", key("max_context_ratio"))],
        "live CPU": [
            Figure("bench_context_quick", "at equal local memory",
                   key("max_context_ratio")),
            Figure("bench_context_quick", "decode step, streamed / resident",
                   key("decode_step_ratio"))]}),
    ("donor interference", "under 10% (from a news summary)", {
        "simulated, compute regime": [
            Figure("simulate_quick", "worst donor P99 TTFT or TPOT increase, donors at half "
                                     "their goodput", key("donor_interference"))],
        "live CPU": [
            Figure("bench_node_quick", "donor burst mean TTFT, lending / stock",
                   key("donor_burst_mean_ratio")),
            Figure("bench_node_quick", "second stock donor / stock (noise floor)",
                   key("donor_burst_mean_noise"))]}),
]


def comparison_rows(records: dict[str, dict], link_prefix: str) -> list[str]:
    """The paper's claims against every column; below it, each cited record's command."""
    names = [c for c, _ in COMPARISON_COLUMNS]
    rows = ["| claim | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
            "| *mechanism tested* | " + " | ".join(f"*{m}*" for _, m in COMPARISON_COLUMNS)
            + " |"]
    cited: list[str] = []
    for claim, paper, cols in COMPARISON:
        cells = [paper]
        for col in names[1:]:
            if col == "GPU":
                cells.append(NONE_RAN)
                continue
            parts = []
            for f in cols.get(col, ["-"]):
                if isinstance(f, str):
                    parts.append(f)
                    continue
                rec = records.get(f.record)
                if f.if_present and (rec is None or f.read(rec["result"]) is None):
                    continue
                if f.record not in cited:
                    cited.append(f.record)
                value = NOT_RECORDED if rec is None else f"`{fmt(f.read(rec['result']))}`"
                parts.append(f"{f.label}: {value} ([{f.record}]({link_prefix}{f.record}.json), "
                             f"{mark(rec)})")
            cells.append("<br>".join(parts) or NOT_RECORDED)
        rows.append(f"| {claim} | " + " | ".join(cells) + " |")
    rows += ["", "Commands of the records cited:", ""]
    for name in cited:
        rec = records.get(name)
        cmd = rec["command"] if rec else RECORDS[name].command
        when = f", {rec['started_utc']} UTC, commit {rec['commit']}, {mark(rec)}" if rec \
            else f" ({NOT_RECORDED})"
        rows.append(f"- [`{name}`]({link_prefix}{name}.json){when}: `{cmd}`")
    return rows


# ---- docs/results.md ---------------------------------------------------------------------------
def record_section(name: str, records: dict[str, dict]) -> str:
    spec = RECORDS[name]
    lines = [f"**Record `{name}`** (method: `{spec.doc}`; make it with "
             f"`python scripts/record_run.py {name} -- {spec.command}`)", ""]
    rec = records.get(name)
    if rec is None:
        return "\n".join(lines + [f"*{NOT_RECORDED}.*"])
    result = rec["result"]
    lines += [f"From {cite(name, rec)}.", ""]
    if spec.simulated:
        lines += ["Every figure below is **simulated**.", ""]
    if spec.derived_note:
        lines += [spec.derived_note, ""]
    lines += ["| key | value | meaning |", "|---|---|---|"]
    derived = set(spec.derive(result)) if spec.derive else set()
    for path, meaning in spec.keys.items():
        value = key(path)(result)
        if value is None and "." not in path and path not in result:
            continue  # an optional key this run did not print
        text = fmt(value)
        if path in derived and text.startswith("(in the record"):
            text = "(in the table below)"
        lines.append(f"| `{path}` | `{text}` | {meaning} |")
    tops = {p.split(".")[0] for p in spec.keys}
    for extra in (k for k in result if k not in tops):
        lines.append(f"| `{extra}` | `{fmt(result[extra])}` | (not described) |")
    if spec.table:
        lines += [""] + spec.table(result)
    return "\n".join(lines)


def headline_rows(records: dict[str, dict], link_prefix: str) -> list[str]:
    """One row per headline figure (docs/results.md)."""
    rows = ["| benchmark | figure | value | record | code | command |",
            "|---|---|---|---|---|---|"]
    for name, spec in RECORDS.items():
        rec = records.get(name)
        for h in spec.headlines:
            if h.if_present and (rec is None or h.read(rec["result"]) is None):
                continue
            if rec is None:
                rows.append(f"| {spec.short} | {h.label} | {NOT_RECORDED} | `{name}` | - | "
                            f"`{spec.command}` |")
                continue
            rows.append(f"| {spec.short} | {h.label} | `{fmt(h.read(rec['result']))}` | "
                        f"[{name}]({link_prefix}{name}.json), {rec['started_utc'][:10]}, "
                        f"{rec['commit']} | {mark(rec)} | `{rec['command']}` |")
    return rows


def summary_rows(records: dict[str, dict], link_prefix: str) -> list[str]:
    """One row per record, its headline figures in one cell (docs/results.md)."""
    rows = ["| benchmark | figures | record, date, commit | code | command |",
            "|---|---|---|---|---|"]
    for name, spec in RECORDS.items():
        rec = records.get(name)
        if rec is None:
            rows.append(f"| {spec.short} | {NOT_RECORDED} | `{name}` | - | `{spec.command}` |")
            continue
        figures = "; ".join(f"{h.label} `{fmt(h.read(rec['result']))}`"
                            for h in spec.headlines if h.readme and not (
                                h.if_present and h.read(rec["result"]) is None))
        rows.append(f"| {spec.short} | {figures} | [{name}]({link_prefix}{name}.json), "
                    f"{rec['started_utc'][:10]}, {rec['commit']} | {mark(rec)} | "
                    f"`{rec['command']}` |")
    return rows


def _with_noise(value: str, noise: str) -> Callable[[dict], Any]:
    """A ratio beside the same ratio between two identical runs (what the machine alone gives)."""
    def read(result: dict) -> Any:
        a, b = key(value)(result), key(noise)(result)
        return None if a is None else f"{rounded(a)} (twin: {rounded(b)})"
    return read


# The README's one table: (where the figure comes from, the figure). Every figure of every record
# is in docs/results.md; these are the ones a user asks about first.
README_FIGURES: list[tuple[str, Figure]] = [
    ("live CPU", Figure("demo", "outputs identical to stock SGLang",
                        of("identical_outputs", "requests"))),
    ("live CPU", Figure("demo", "prompt tokens from cache, SwiftCache / stock",
                        key("cached_ratio"))),
    ("live CPU", Figure("bench_node_quick", "busy model's cached tokens, SwiftCache / stock",
                        key("busy_cached_ratio"))),
    ("live CPU", Figure("bench_node_quick", "donor burst mean TTFT, lending / stock",
                        _with_noise("donor_burst_mean_ratio", "donor_burst_mean_noise"))),
    ("live CPU", Figure("bench_tiers_quick", "cached tokens with a host tier, SwiftCache / "
                                             "HiCache", key("cached_vs_hicache"))),
    ("live CPU", Figure("bench_tiers_quick", "TTFT P99 with a host tier, SwiftCache / HiCache",
                        _with_noise("ttft_p99_vs_hicache", "ttft_p99_noise"))),
    ("live CPU", Figure("bench_multiturn_quick", "bench_multiturn, 16 clients, TTFT P99 / stock, "
                                                 "streaming from donor pages",
                        key("16.stream_ttft_p99_vs_stock.mean"))),
    ("live CPU", Figure("bench_multiturn_quick", "bench_multiturn, 16 clients, mean TTFT / "
                                                 "stock with the loan in its pool, streaming",
                        _with_noise("16.stream_ttft_avg_vs_ideal.mean",
                                    "16.twin_ttft_avg_vs_ideal.mean"))),
    ("live CPU", Figure("chaos_quick", "wrong tokens, hangs under faults",
                        of("wrong_tokens", "hangs", sep=", "))),
    ("live CPU", Figure("bench_context_quick", "longest context / stock, equal local KV memory",
                        key("max_context_ratio"))),
    ("live CPU", Figure("bench_overlap_quick", "scheduler wait per donor load, P99 (ms)",
                        key("stall_ms_p99"))),
    ("live CPU", Figure("bench_sched_overhead_quick", "scheduler step, borrower with hits / "
                                                      "stock", _with_noise(
                            "overhead_ratio_borrower", "noise_ratio"))),
    ("**simulated**", Figure("simulate_quick", "goodput / HiCache, compute regime",
                             key(_CR + "goodput_ratio_vs_hicache"))),
    ("**simulated**", Figure("simulate_grid_seeds", "goodput / HiCache, capacity regime, 3 seeds",
                             _grid_cell(None, "goodput_ratio_vs_hicache"))),
    ("**simulated**", Figure("simulate_grid_seeds", "P99 TTFT reduction vs HiCache at 80% of "
                                                    "its goodput, same cell",
                             _grid_cell(None, "p99_ttft_reduction_at_80pct"))),
    ("**simulated** vs live CPU", Figure("simulate_validate_tiers", "simulator validated: "
                                         "figures within 20% of live",
                                         lambda r: _count_true(r.get("within_20pct")))),
]


def readme_rows(records: dict[str, dict], link_prefix: str) -> list[str]:
    """The README's table: each figure with its record and whether that record is current."""
    rows = ["| figure | from | value | record | code |", "|---|---|---|---|---|"]
    for where, f in README_FIGURES:
        rec = records.get(f.record)
        value = NOT_RECORDED if rec is None else f"`{fmt(f.read(rec['result']))}`"
        rows.append(f"| {f.label} | {where} | {value} | "
                    f"[{f.record}]({link_prefix}{f.record}.json) | {mark(rec)} |")
    return rows


# ---- the multi-turn benchmark's targets, over every seed of one product -----------------------
# The records pooled (the first is the full one, whose product the others must share; each of the
# others runs seeds the full record does not, 4 and up, and none shares a server and client count
# with another), SwiftCache's servers by key prefix, and the targets (docs/node_bench.md).
MULTITURN_POOL = ("bench_multiturn", "bench_multiturn_more_seeds", "bench_multiturn_more_seeds_8",
                  "bench_multiturn_donor_tier_16")
MULTITURN_SERVERS = (("mapped_", "read in place (depth 0, CPU only)"),
                     ("stream_", "streaming from donor pages (depth 2)"),
                     ("", "donor tier"))
AVG_TARGET, P99_TARGET = 1.10, 1.20


def pooled(parts: list[dict]) -> dict | None:
    """One ratio over the seeds of several runs, from each run's summary over its seeds
    (`mean`, `worst` = max, `spread` = max - min, and `seeds`): the mean weighted by seeds, the
    worst, and the spread (the smallest seed of a run is its worst minus its spread)."""
    parts = [p for p in parts if p.get("mean") is not None]
    if not parts:
        return None
    seeds = sum(p["seeds"] for p in parts)
    worst = max(p["worst"] for p in parts)
    least = min(p["worst"] - p["spread"] for p in parts)
    return {"mean": sum(p["mean"] * p["seeds"] for p in parts) / seeds, "worst": worst,
            "spread": worst - least, "seeds": seeds}


def pooled_records(records: dict[str, dict]) -> list[str]:
    """The records of MULTITURN_POOL present and of the full record's product (none without it)."""
    base = records.get(MULTITURN_POOL[0])
    if base is None:
        return []
    return [n for n in MULTITURN_POOL
            if n in records and records[n].get("product_tree") == base.get("product_tree")]


def multiturn_targets(records: dict[str, dict]) -> dict:
    """Per client count and SwiftCache server, its ratios pooled over every run of the full
    record's product that has it (`pooled`), the twin's pooled over the same runs (the same
    seeds), and the targets it misses."""
    runs = [records[n] for n in pooled_records(records)]
    out: dict = {}
    for n in ("8", "16", "32"):
        for pre, label in MULTITURN_SERVERS:
            points = [r["result"][n] for r in runs if pre + "ttft_avg_vs_ideal" in
                      (r["result"].get(n) or {})]
            if not points:
                continue

            def pool(k: str, points=points) -> dict | None:
                return pooled([{**p[k], "seeds": p["seeds"]} for p in points if k in p])

            row = {k: pool(pre + k) for k in ("ttft_p99_vs_stock", "ttft_avg_vs_ideal",
                                              "ttft_p99_vs_ideal")}
            row.update(twin_avg=pool("twin_ttft_avg_vs_ideal"),
                       twin_p99=pool("twin_ttft_p99_vs_ideal"))
            if None in row.values():
                continue
            missed = []
            if row["ttft_p99_vs_stock"]["worst"] > 1.0:
                missed.append("P99 above stock's in a run")
            if row["ttft_avg_vs_ideal"]["mean"] > AVG_TARGET:
                missed.append(f"mean TTFT above {AVG_TARGET:.2f}x the ideal's")
            if row["ttft_p99_vs_ideal"]["mean"] > P99_TARGET:
                missed.append(f"P99 above {P99_TARGET:.2f}x the ideal's")
            if row["ttft_avg_vs_ideal"]["spread"] > row["twin_avg"]["spread"]:
                missed.append("mean TTFT's spread wider than the twin's")
            if row["ttft_p99_vs_ideal"]["spread"] > row["twin_p99"]["spread"]:
                missed.append("P99's spread wider than the twin's")
            out[(n, label)] = {**row, "missed": missed,
                               "seeds": row["ttft_avg_vs_ideal"]["seeds"]}
    return out


def multiturn_target_rows(records: dict[str, dict]) -> list[str]:
    """The table of `multiturn_targets` (docs/results.md), ratios to two decimals."""
    verdict = multiturn_targets(records)
    if not verdict:
        return [f"*{NOT_RECORDED}.*"]
    base = records[MULTITURN_POOL[0]]
    used = ", ".join(f"[{n}](records/{n}.json) ({mark(records[n])})"
                     for n in pooled_records(records))
    rows = [f"Pooled from {used}, product tree {base['product_tree']}: each ratio's mean over "
            "every seed that ran it, weighted by seeds; the worst run and the spread (max - min) "
            "over the same seeds; the ideal twin's over the same seeds.", "",
            "| clients | SwiftCache server | seeds | TTFT P99 / stock, worst run (target <= 1) "
            f"| mean TTFT / ideal, mean (<= {AVG_TARGET:.2f}) | TTFT P99 / ideal, mean "
            f"(<= {P99_TARGET:.2f}) | mean TTFT / ideal, spread (twin's) | TTFT P99 / ideal, "
            "spread (twin's) | targets missed |", "|---|---|---|---|---|---|---|---|---|"]
    for (n, label), r in verdict.items():
        cells = [n, label, str(r["seeds"]), f"{r['ttft_p99_vs_stock']['worst']:.2f}",
                 f"{r['ttft_avg_vs_ideal']['mean']:.2f}", f"{r['ttft_p99_vs_ideal']['mean']:.2f}",
                 f"{r['ttft_avg_vs_ideal']['spread']:.2f} ({r['twin_avg']['spread']:.2f})",
                 f"{r['ttft_p99_vs_ideal']['spread']:.2f} ({r['twin_p99']['spread']:.2f})",
                 "; ".join(r["missed"]) or "none"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def render_results_md(template: str, records: dict[str, dict]) -> str:
    text = template.replace("{{headlines}}", "\n".join(headline_rows(records, "records/")))
    text = text.replace("{{multiturn_targets}}", "\n".join(multiturn_target_rows(records)))
    text = text.replace("{{comparison}}", "\n".join(comparison_rows(records, "records/")))
    text = text.replace("{{grid}}", "\n".join(grid_rows(records, "records/")))
    text = text.replace("{{records}}", "\n".join(summary_rows(records, "records/")))
    for name in RECORDS:
        text = text.replace("{{record " + name + "}}", record_section(name, records))
    unknown = [line for line in text.splitlines() if "{{" in line]
    if unknown:
        raise ValueError(f"docs/results.template.md: unknown placeholder in {unknown[0]!r}")
    return text


# ---- README.md ---------------------------------------------------------------------------------
def options_table() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from sglang_swift.config import cli_options

    rows = ["| option | default | meaning |", "|---|---|---|"]
    for flag, f in cli_options():
        meaning = f.metadata["help"].replace("<", "&lt;").replace(">", "&gt;")
        rows.append(f"| `{flag}` | `{f.default!r}` | {meaning} |")
    return rows


def replace_between(text: str, name: str, body: list[str]) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"README.md needs one {begin} ... {end} pair")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return head + begin + "\n" + "\n".join(body) + "\n" + end + tail


def render_readme(readme: str, records: dict[str, dict]) -> str:
    readme = replace_between(readme, "results", readme_rows(records, "docs/records/"))
    return replace_between(readme, "options", options_table())


# ---- main --------------------------------------------------------------------------------------
def product_now(root: Path, against: str | None = None) -> str | None:
    """The product tree records are compared with: the working tree's, or a revision's."""
    return _record_run().product_tree(against, root)


def stale_report(records: dict[str, dict]) -> list[str]:
    """One line per record not provably run on the product compared with."""
    lines = []
    for name, rec in records.items():
        f = rec["_freshness"]
        if not f.current:
            lines.append(f"{name}: {f.mark().replace('**', '')} (ran on product tree "
                         f"{f.ran_on or 'unknown'}, commit {rec.get('commit')}; compared with "
                         f"{f.now or 'unknown'})")
    return lines


def refresh_plan(records: dict[str, dict], stale_only: bool = False, cpus: int | None = None
                 ) -> list[tuple[str, list[str]]]:
    """(name, command) for each record to re-run here, in RECORDS order: its own recorded
    command (a missing record: its spec's), skipping those that ran on more CPUs than `cpus`
    and, with stale_only, those already current."""
    plan = []
    for name, spec in RECORDS.items():
        rec = records.get(name)
        if stale_only and rec is not None and rec["_freshness"].current:
            continue
        if rec is not None and cpus is not None and (rec.get("machine", {}).get("cpus")
                                                       or 0) > cpus:
            continue
        cmd = rec["command"] if rec else spec.command.replace("python ", ".venv/bin/python ")
        plan.append((name, shlex.split(cmd)))
    return plan


def render(root: Path, against: str | None = None) -> dict[Path, str]:
    """Every generated page under `root`, as it should read."""
    records = load_records(root / "docs" / "records", product_now(root, against), root)
    template = (root / "docs" / "results.template.md").read_text()
    return {root / "docs" / "results.md": render_results_md(template, records),
            root / "README.md": render_readme((root / "README.md").read_text(), records)}


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when a page differs from what the records "
                         "render; list the records that are not current")
    ap.add_argument("--fail-stale", action="store_true",
                    help="exit 2 (when the pages are up to date) if a record is stale, unknown, "
                         "or ran on an uncommitted tree its record cannot pin down")
    ap.add_argument("--against", metavar="REV",
                    help="compare records with this revision's product tree (default: the "
                         "working tree's)")
    ap.add_argument("--refresh-plan", action="store_true",
                    help="print NAME<TAB>COMMAND for each record to re-run on this machine "
                         "(scripts/refresh_records.sh reads it) and exit")
    ap.add_argument("--stale-only", action="store_true",
                    help="with --refresh-plan: only the records that are not current")
    args = ap.parse_args(argv)
    records = load_records(root / "docs" / "records", product_now(root, args.against), root)
    if args.refresh_plan:
        for name, cmd in refresh_plan(records, args.stale_only, os.cpu_count()):
            print(f"{name}\t{shlex.join(cmd)}")
        return 0
    pages = render(root, args.against)
    outdated = [p for p, text in pages.items() if not p.exists() or p.read_text() != text]
    not_current = stale_report(records)
    if args.check or args.fail_stale:
        for p in outdated:
            print(f"{p.relative_to(root)} is out of date with docs/records/; "
                  f"run: python scripts/render_results.py", file=sys.stderr)
        for line in not_current:
            print(f"not current: {line}", file=sys.stderr)
        if outdated:
            return 1
        return 2 if args.fail_stale and not_current else 0
    for p in outdated:
        p.write_text(pages[p])
        print(f"wrote {p.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
