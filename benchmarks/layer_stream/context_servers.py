"""The live servers as bench_context sees them: deterministic prompts, greedy generation, the
context probe and its binary search, forward traces, and what a streamed server's log says
(its pool, its resident tokens, its store on a donor)."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Callable

VOCAB_LO, VOCAB_HI = 50, 1950  # token ids used in prompts (clear of the special tokens)


def prompt_ids(n: int, salt: int) -> list[int]:
    """A deterministic prompt of n tokens; different salts differ from the first token."""
    span = VOCAB_HI - VOCAB_LO
    return [VOCAB_LO + (i * 37 + salt * 101 + 11) % span for i in range(n)]


def generate(server, ids: list[int], new: int) -> list[int] | None:
    """Greedy output ids, or None when the server refuses the request (HTTP 4xx/5xx)."""
    try:
        out = server.post("/generate", {"input_ids": ids, "sampling_params": {
            "max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}}, timeout=900)
    except urllib.error.HTTPError:
        return None
    return out["output_ids"]


def flush_cache(server, timeout_s: float = 60.0) -> None:
    """Empty the server's radix cache (SGLang's POST /flush_cache, which waits up to timeout_s
    for the server to be idle): the next request then gets the lowest free slots."""
    req = urllib.request.Request(f"{server.base_url}/flush_cache?timeout={timeout_s:g}",
                                 data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout_s + 30) as r:
        r.read()


class ContextProbe:
    """served(c) for one server against the reference; remembers every verdict."""

    def __init__(self, server, reference_outputs: Callable[[int], list[int]], out_tokens: int):
        self.server = server
        self.reference_outputs = reference_outputs
        self.out_tokens = out_tokens
        self.verdicts: dict[int, str] = {}

    def __call__(self, context: int) -> bool:
        got = generate(self.server, prompt_ids(context - self.out_tokens, context),
                       self.out_tokens)
        if got is None:
            verdict = "refused"
        elif len(got) < self.out_tokens:
            verdict = "truncated"  # the pool had no room for the whole output
        elif got != self.reference_outputs(context):
            verdict = "differs"
        else:
            verdict = "served"
        self.verdicts[context] = verdict
        return verdict == "served"

    @property
    def identical(self) -> bool:
        """No full-length output ever differed from the reference's."""
        return "differs" not in self.verdicts.values()


def longest_served(served: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest c in [lo, hi] with served(c), assuming served is true up to some point and
    false after it; lo - 1 when even lo is not served."""
    if not served(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if served(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def read_trace(path: str, offset: int) -> tuple[list[dict], int]:
    """Forward records appended to `path` since `offset`, and the new offset."""
    try:
        with open(path, encoding="utf-8") as f:
            f.seek(offset)
            text = f.read()
    except FileNotFoundError:
        return [], offset
    return [json.loads(line) for line in text.splitlines() if line.strip()], offset + len(text)


def model_shape(model_dir) -> dict:
    with open(f"{model_dir}/config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    heads = cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"layers": cfg["num_hidden_layers"], "row_bytes": 2 * heads * head_dim * 4}  # fp32


def streamed_pool_log(log: str) -> dict:
    """What the streamed server says about its own pool."""
    m = re.search(r"KV pool of (\d+) tokens; local staging (\d+) of (\d+) layers \(([\d.]+) "
                  r"MiB\), every layer in (.+?) \(([\d.]+) MiB\)", log)
    if not m:
        raise RuntimeError("the streamed server did not log its pool; is layer streaming on?")
    return {"tokens": int(m[1]), "depth": int(m[2]), "layers": int(m[3]),
            "local_mib": float(m[4]), "store": m[5], "store_mib": float(m[6])}


def logged_resident_tokens(log: str) -> int:
    """R from the streamed server's pool line ("...; R resident tokens (...)")."""
    m = re.search(r"KV pool of \d+ tokens; .*?; (\d+) resident tokens", log)
    if not m:
        raise RuntimeError("the streamed server did not log its resident tokens")
    return int(m[1])


STORE_PLACED = r"stream from donor memory \((\d+) of (\d+)\)"  # depth 2 and more: store pages
MAPPED_PLACED = r"read in place from donor memory \((\d+) of (\d+)\)"  # depth 0: pieces


def wait_store_on_donor(server, timeout_s: float = 300.0, pattern: str = STORE_PLACED,
                        key: str = "store_pages_on_donor") -> dict:
    """Block until the streamed server logs every store page (`pattern`: or, at depth 0, every
    piece) placed on donor memory; returns {key: how many}."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        placed = re.findall(pattern, server.log_text())
        if placed and placed[-1][0] == placed[-1][1]:
            return {key: int(placed[-1][0])}
        time.sleep(1.0)  # polling another process's log
    raise RuntimeError(f"the streamed server did not place its rows on the donor within "
                       f"{timeout_s:.0f} s; see {server.log_path}")


def donor_reads(log: str) -> int:
    """Store rows the streamed server read from donor memory (the largest count its stats
    lines show; they only grow)."""
    return max([int(n) for n in re.findall(r"'stream_rows_from_donor': (\d+)", log)] or [0])
