"""Maximum context and the cost of streaming it (SIMULATED), from the stepwise layer stream model.

A sweep over context lengths admits a request the way a server would and runs the admitted ones
through `layer_stream.run_request` (chunked prefill, then decode steps, per layer on the links):
- stock SGLang and vLLM keep a running request's whole KV in the local pool, so they admit a
  context only if its KV fits the pool (and the model's window);
- a streaming SwiftCache server admits it if its KV fits the streamable memory (the donor lease,
  then host memory) while the D staging layers of it fit the local pool (and the window).
The largest admitted context is the maximum; the simulated events give TTFT and the decode step
at each swept length, against the same request resident (a GPU whose pool would hold it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import params
from .capacity import device_pages, lend_blocks, page_bytes
from .layer_stream import StreamSetup, run_request
from .roofline import Roofline

DECODE_STEPS = 2  # decode steps simulated per swept length (the step time is their mean)


@dataclass(frozen=True)
class LongContext:
    """One long-context node: `model` on `gpu`, `donors` lending `lend_fraction` of their pools."""

    name: str
    gpu: str
    model: str
    donors: tuple[str, ...]
    lend_fraction: float = 0.5
    depth: int = int(params.LONG_CONTEXT["depth"].value)
    host_bytes: float = (params.LONG_CONTEXT["node_host_bytes"].value
                         * params.LONG_CONTEXT["host_share"].value)
    window: int = 0  # tokens; 0: no window limit
    # of the local KV memory, the part kept as every layer's own rows (the live
    # --swiftcache-layer-stream-resident-fraction; 0: every row streamed)
    resident_fraction: float = 0.0
    # the live store: every row in host memory, the leases holding copies (layer_stream.py)
    host_backed: bool = False

    def roofline(self) -> Roofline:
        hw = params.gpu(self.gpu)
        return Roofline(params.MODELS[self.model], hw["bf16_flops"], hw["hbm_bw"],
                        params.EFFICIENCY["compute"].value, params.EFFICIENCY["hbm"].value)

    def local_bytes(self) -> float:
        """The local KV pool (HBM - SGLang's reserve - weights): the same for stock and
        streaming."""
        return params.kv_pool_bytes(self.gpu, params.MODELS[self.model])

    def donor_bytes(self) -> tuple[float, ...]:
        """Each donor's lease in bytes: whole pages of this model (what `Node.lend` grants)."""
        mpage = page_bytes(self.model)
        return tuple(lend_blocks(self.lend_fraction, device_pages(self.gpu, d) * page_bytes(d),
                                 mpage) * mpage
                     for d in self.donors)

    def resident_tokens(self) -> int:
        """Tokens whose every layer is local: the resident part of local memory over a token's
        KV (L R rows are the fraction f of the local rows)."""
        kv = params.MODELS[self.model].kv_bytes_per_token
        return int(self.resident_fraction * self.local_bytes() // kv)

    def stream_setup(self, *, nvlink_bw: float | None = None, pcie_bw: float | None = None,
                     depth: int | None = None) -> StreamSetup:
        hw = params.gpu(self.gpu)
        return StreamSetup(self.roofline(), depth or self.depth, self.donor_bytes(),
                           self.host_bytes, nvlink_bw or hw["nvlink_bw_dir"],
                           pcie_bw or hw["pcie_bw_dir"],
                           int(params.SGLANG["chunked_prefill_size"].value),
                           self.resident_tokens(), self.host_backed)


LWM_H20 = LongContext("paper-4xH20/LWM", "H20", "LWM-Text-1M",
                      ("Qwen3-14B", "Qwen3-8B", "Qwen3-4B"),
                      window=int(params.LONG_CONTEXT["window_tokens"].value))


def admits_resident(lc: LongContext, n: int) -> bool:
    kv = n * params.MODELS[lc.model].kv_bytes_per_token
    return (lc.window == 0 or n <= lc.window) and kv <= lc.local_bytes()


def admits_streamed(lc: LongContext, ss: StreamSetup, n: int) -> bool:
    """Its KV (and that of the decode steps) fits the streamable memory, and the local rows hold
    it: every layer of the resident tokens, D layers of the rest."""
    need = n + DECODE_STEPS
    r = ss.resident_tokens
    rows = ss.roofline.model.layers * min(r, need) + ss.depth * max(0, need - r)
    return ((lc.window == 0 or need <= lc.window) and ss.fits(need)
            and rows * ss.layer_token_bytes <= lc.local_bytes())


def sweep(admits, probe, start: int = 4096, resolution: int = 64) -> tuple[int, list[dict]]:
    """Double the context from `start` while `admits(n)`, then bisect to `resolution` tokens;
    `probe(n)` simulates each admitted length. Returns (largest admitted, probes in order)."""
    probes: list[dict] = []
    if not admits(start):
        return 0, probes
    lo, hi = start, None
    probes.append(probe(lo))
    while hi is None:
        n = lo * 2
        if admits(n):
            lo = n
            probes.append(probe(n))
        else:
            hi = n
    while hi - lo > resolution:
        mid = (lo + hi) // 2 // resolution * resolution
        if mid <= lo:
            break
        if admits(mid):
            lo = mid
            probes.append(probe(mid))
        else:
            hi = mid
    return lo, probes


def probe(ss: StreamSetup, n: int) -> dict:
    """One length, streamed and resident: TTFT, decode step and their ratios."""
    s = run_request(ss, n, DECODE_STEPS, streamed=True)
    r = run_request(ss, n, DECODE_STEPS, streamed=False)
    return {"context": n, "ttft_s": s["ttft_s"], "ttft_resident_s": r["ttft_s"],
            "decode_step_s": s["decode_step_s"], "decode_step_resident_s": r["decode_step_s"],
            "prefill_slowdown": s["ttft_s"] / r["ttft_s"],
            "decode_slowdown": s["decode_step_s"] / r["decode_step_s"],
            "load_bytes": s["load_bytes"], "write_bytes": s["write_bytes"]}


def max_context(lc: LongContext, **links) -> dict:
    """Stock SGLang / vLLM against SwiftCache's streaming, each from its admission sweep, with the
    simulated costs at the lengths that matter (the baseline's maximum and SwiftCache's)."""
    ss = lc.stream_setup(**links)
    base, _ = sweep(lambda n: admits_resident(lc, n), lambda n: {"context": n})
    swift, probes = sweep(lambda n: admits_streamed(lc, ss, n), lambda n: probe(ss, n))
    at_max = (probes[-1] if probes and probes[-1]["context"] == swift
              else (probe(ss, swift) if swift else None))
    at_base = probe(ss, base) if base and admits_streamed(lc, ss, base) else None
    kv = params.MODELS[lc.model].kv_bytes_per_token
    return {
        "setup": lc.name, "gpu": lc.gpu, "model": lc.model, "depth": ss.depth,
        "local_kv_gb": lc.local_bytes() / 1e9, "lent_gb": sum(ss.donor_bytes) / 1e9,
        "host_gb": ss.host_bytes / 1e9, "lend_fraction": lc.lend_fraction,
        "resident_fraction": lc.resident_fraction, "host_backed": lc.host_backed,
        "nvlink_bw": ss.nvlink_bw, "pcie_bw": ss.pcie_bw,
        "memory_bound_tokens": {
            "streamable": int(ss.streamable_bytes // kv) - DECODE_STEPS,
            "staging": int(ss.resident_tokens + (lc.local_bytes() - ss.resident_tokens
                                                  * kv) // (ss.depth * ss.layer_token_bytes))
                       - DECODE_STEPS,
            "window": lc.window or None},
        "max_tokens": {"sglang": base, "vllm": base, "swiftcache": swift},
        "ratio": swift / base if base else None,
        "at_max": at_max, "at_baseline_max": at_base, "probes": probes,
    }


def depth_and_links(lc: LongContext, context: int, depths=(1, 2, 3, 4)) -> list[dict]:
    """The decode step at one length for several staging depths, and all-donor / all-host
    placements (what each link alone costs)."""
    rows = []
    for d in depths:
        rows.append({"case": f"depth {d}", **probe(lc.stream_setup(depth=d), context)})
    n_bytes = (context + DECODE_STEPS) * params.MODELS[lc.model].kv_bytes_per_token
    donor_only = replace(lc.stream_setup(), donor_bytes=(n_bytes,), host_bytes=0.0)
    host_only = replace(lc.stream_setup(), donor_bytes=(), host_bytes=n_bytes)
    rows.append({"case": "all in donor HBM (NVLink)", **probe(donor_only, context)})
    rows.append({"case": "all in host memory (PCIe)", **probe(host_only, context)})
    return rows


def scenario_report(lc: LongContext = LWM_H20, fractions=(0.25, 0.5, 0.75)) -> dict:
    """The long-context scenario: the maximum context sweep, its sensitivity to the lend
    fraction, and the per-token cost by depth and by link at the baseline's maximum and ours."""
    main = max_context(lc)
    return {"main": main,
            "by_lend_fraction": [{k: v for k, v in max_context(replace(lc, lend_fraction=f)).items()
                                  if k != "probes"} for f in fractions],
            "by_depth_and_link": {str(n): depth_and_links(lc, n)
                                  for n in (main["max_tokens"]["sglang"],
                                            main["max_tokens"]["swiftcache"]) if n}}


def report_md(rep: dict) -> str:
    """Markdown tables of `scenario_report` (every figure SIMULATED)."""
    m = rep["main"]
    lines = [f"{m['model']} on {m['gpu']} (SIMULATED, stepwise streaming, depth {m['depth']}): "
             f"local KV pool {m['local_kv_gb']:.1f} GB, donor lease {m['lent_gb']:.1f} GB "
             f"(lend fraction {m['lend_fraction']}), host {m['host_gb']:.1f} GB; bounds in tokens: "
             f"streamable {m['memory_bound_tokens']['streamable']:,}, "
             f"staging {m['memory_bound_tokens']['staging']:,}, "
             f"window {m['memory_bound_tokens']['window'] or '-'}",
             "", "| system | max context (tokens) | vs SGLang |", "|---|---|---|"]
    for k, v in m["max_tokens"].items():
        lines.append(f"| {k} | {v:,} | {v / m['max_tokens']['sglang']:.2f}x |")
    lines += ["", "| context (tokens) | TTFT streamed / resident (s) | prefill slowdown "
              "| decode step streamed / resident (ms) | per-token slowdown |",
              "|---|---|---|---|---|"]
    for p in m["probes"]:
        lines.append(f"| {p['context']:,} | {p['ttft_s']:.2f} / {p['ttft_resident_s']:.2f} "
                     f"| x{p['prefill_slowdown']:.3f} "
                     f"| {p['decode_step_s'] * 1e3:.1f} / "
                     f"{p['decode_step_resident_s'] * 1e3:.1f} | "
                     f"x{p['decode_slowdown']:.2f} |")
    lines += ["", "| lend fraction | donor lease GB | SwiftCache max context | vs SGLang |",
              "|---|---|---|---|"]
    for r in rep["by_lend_fraction"]:
        lines.append(f"| {r['lend_fraction']} | {r['lent_gb']:.1f} | "
                     f"{r['max_tokens']['swiftcache']:,} | {r['ratio']:.2f}x |")
    for n, rows in rep["by_depth_and_link"].items():
        lines += ["", f"At {int(n):,} tokens:", "",
                  "| case | decode step streamed / resident (ms) | per-token slowdown "
                  "| TTFT slowdown |", "|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['case']} | {r['decode_step_s'] * 1e3:.1f} / "
                         f"{r['decode_step_resident_s'] * 1e3:.1f} | "
                         f"x{r['decode_slowdown']:.2f} | x{r['prefill_slowdown']:.3f} |")
    return "\n".join(lines)


SWEEP = dict(lend_fraction=(0.5, 0.75, 1.0), host_gb=(0.0, 64.0), resident_fraction=(0.0, 0.5),
             host_backed=(True, False))
PAPER_RATIO = 3.98  # the SwiftCache paper's maximum-context gain (arXiv 2606.16135, abstract)


def sweep_report(lc: LongContext = LWM_H20, grid: dict = SWEEP) -> dict:
    """Idle donors: every lend fraction x host memory x resident fraction x backing; per
    configuration the longest context, its ratio to stock, and the decode step there."""
    rows = []
    for backed in grid["host_backed"]:
        for f in grid["lend_fraction"]:
            for h in grid["host_gb"]:
                for r in grid["resident_fraction"]:
                    c = replace(lc, lend_fraction=f, host_bytes=h * 1e9, resident_fraction=r,
                                host_backed=backed)
                    m = max_context(c)
                    at = m["at_max"]
                    rows.append({
                        "backing": "host (live)" if backed else "donor + host (additive)",
                        "lend_fraction": f, "host_gb": h, "resident_fraction": r,
                        "lent_gb": round(m["lent_gb"], 1),
                        "max_context_tokens": m["max_tokens"]["swiftcache"],
                        # 0 tokens: nothing streams (the live store needs host memory)
                        "ratio": (round(m["ratio"], 3) if m["ratio"]
                                  and m["max_tokens"]["swiftcache"] else None),
                        "decode_step_ms": round(at["decode_step_s"] * 1e3, 2) if at else None,
                        "decode_step_resident_ms": (round(at["decode_step_resident_s"] * 1e3, 2)
                                                    if at else None),
                        "decode_slowdown": round(at["decode_slowdown"], 3) if at else None})
    base = max_context(lc)["max_tokens"]["sglang"]
    reach = [r for r in rows if r["ratio"] is not None and r["ratio"] >= PAPER_RATIO]
    return {"model": lc.model, "gpu": lc.gpu, "depth": lc.depth, "stock_max_tokens": base,
            "window_tokens": lc.window, "rows": rows, "paper_ratio": PAPER_RATIO,
            "reaches_paper_ratio": [{k: r[k] for k in ("backing", "lend_fraction", "host_gb",
                                                       "resident_fraction", "ratio",
                                                       "decode_step_ms", "decode_slowdown")}
                                    for r in reach]}


def sweep_md(rep: dict) -> str:
    lines = [f"{rep['model']} on {rep['gpu']} (SIMULATED, depth {rep['depth']}, idle donors): "
             f"stock SGLang's longest context {rep['stock_max_tokens']:,} tokens, window "
             f"{rep['window_tokens']:,}", "",
             "| backing | lend fraction | lease GB | host GB | resident fraction | longest context "
             "| vs stock | decode step there, streamed / resident (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        step = (f"{r['decode_step_ms']:.1f} / {r['decode_step_resident_ms']:.1f} "
                f"(x{r['decode_slowdown']:.2f})" if r["decode_step_ms"] is not None else "-")
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "cannot stream"
        lines.append(f"| {r['backing']} | {r['lend_fraction']} | {r['lent_gb']} | {r['host_gb']:g} "
                     f"| {r['resident_fraction']} | {r['max_context_tokens']:,} | {ratio} "
                     f"| {step} |")
    return "\n".join(lines)
