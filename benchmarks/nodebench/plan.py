"""What the node benchmark runs: pool sizes, traffic sizes, and the three runs' servers.

Sizes follow one rule: both servers get the same memory. The busy model (the `small` shape,
8 KiB of KV per token) gets a 1024-token pool, 8 MiB; the donor (the `tiny` shape, 2 KiB per
token) gets 4096 tokens, also 8 MiB, and lends half of it. What the donor lends is worth
`lent bytes / 8 KiB` tokens to the busy model (512 here), which is what run (c) adds to the busy
server's own pool, and takes away from the donor's, so all three runs hold the same total memory.

The three runs (same traffic each):
- `stock`      (a) stock SGLang, both servers with the pools of (b);
- `swiftcache` (b) SwiftCache: the donor lends from its pool, the busy server borrows;
- `ideal`      (c) stock SGLang, the capacity lent in (b) moved into the busy server's own pool.

`busy_tp` > 1 runs every busy server with `--tp busy_tp` (the donor stays at TP 1). SGLang reads
`--max-total-tokens` as each rank's pool in tokens, each rank holding its share of the KV heads,
so the busy pool's tokens and bytes do not change with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# every server: the cache report (cached_tokens per request), fp32 (the models' dtype), /metrics
# for the capacity sampler (no idle spinning on the CPU engine: LocalServer's CPU_ARGS)
COMMON_ARGS = ("--enable-cache-report", "--dtype", "float32", "--enable-metrics")
# a loaded 2-core machine can starve a control agent's thread for a second or more
HEARTBEAT_ARGS = ("--swiftcache-heartbeat-timeout-s", "3", "--swiftcache-heartbeat-interval-s",
                  "0.3")
# SGLang's CPU engine binds each TP rank's threads to the cores listed for it ("0|1": rank 0 on
# core 0, rank 1 on core 1); without it, it wants one NUMA node per rank and refuses
TP_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class ModelFacts:
    """What a Llama-style config.json says about a model's KV and compute per token."""

    name: str
    layers: int
    kv_bytes_per_token: int
    matmul_flops_per_token: int  # 2 x weights a token multiplies (lm_head in, embedding out)
    attn_flops_per_context_token: int  # QK^T and PV: 4 x layers x q_heads x head_dim
    kv_heads: int = 1  # num_key_value_heads: a TP server gives each rank an equal share
    q_heads: int = 1

    @property
    def flops_per_kv_byte(self) -> float:
        """Prefill FLOPs (matmuls only) per byte of KV the token writes: how much compute a
        cached byte saves. Attention adds attn_flops_per_context_token per token of context."""
        return self.matmul_flops_per_token / self.kv_bytes_per_token

    @classmethod
    def from_config(cls, name: str, cfg: dict) -> "ModelFacts":
        hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
        q_heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        head_dim = cfg.get("head_dim") or hidden // q_heads
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{name}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        per_layer = (hidden * q_heads * head_dim + 2 * hidden * kv_heads * head_dim
                     + q_heads * head_dim * hidden + 3 * hidden * cfg["intermediate_size"])
        weights = layers * per_layer + hidden * cfg["vocab_size"]
        return cls(name=name, layers=layers,
                   kv_bytes_per_token=2 * layers * kv_heads * head_dim * DTYPE_BYTES[dtype],
                   matmul_flops_per_token=2 * weights,
                   attn_flops_per_context_token=4 * layers * q_heads * head_dim,
                   kv_heads=kv_heads, q_heads=q_heads)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelFacts":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return cls.from_config(Path(model_dir).name, cfg)

    def tp_sizes(self) -> list[int]:
        """The TP sizes that split both head counts evenly: every rank keeps whole KV heads, and
        every rank's KV shard has the same shape (SwiftCache refuses ranks whose shards differ;
        SGLang itself would replicate heads where the TP exceeds them)."""
        return [n for n in range(1, self.kv_heads + 1)
                if self.kv_heads % n == 0 and self.q_heads % n == 0]

    def describe(self) -> str:
        return (f"{self.name}: {self.layers} layers, {self.kv_bytes_per_token} B of KV per "
                f"token, {self.flops_per_kv_byte / 1e3:.2f} kFLOP per KV byte (matmuls; "
                f"+{self.attn_flops_per_context_token} FLOP per context token for attention)")


@dataclass(frozen=True)
class NodePlan:
    """Sizes of one benchmark. Pools in each model's own tokens."""

    busy_pool: int = 1024
    donor_pool: int = 4096
    lend_fraction: float = 0.5
    reclaim_watermark: float = 0.8  # SwiftCache's default
    conversations: int = 8  # busy model: ShareGPT conversations, interleaved turn by turn
    turns: int = 6  # in the steady phase; one more turn each is sent after the donor's bursts
    max_tokens: int = 16
    max_chars: int = 600  # per message, so prompts stay within what a CPU serves in seconds
    donor_conversations: int = 2  # donor: light traffic, one request every donor_interval_s
    donor_requests: int = 32  # enough that its TTFT P99 is not just its slowest request
    donor_interval_s: float = 1.0
    donor_max_tokens: int = 8
    burst_requests: int = 6  # donor: concurrent long requests, after the steady phase
    burst_fraction: float = 0.6  # their prompt tokens together, as a fraction of the donor pool
    burst_max_tokens: int = 16
    # bursts per donor, in rounds that put the three runs' bursts back to back: two stock servers
    # side by side over 8 rounds had burst P99s within 3% of each other, where single bursts of
    # one server ranged 100-160 ms on a 2-core CPU machine (docs/node_bench.md)
    burst_rounds: int = 8
    # torch threads per server (OMP_NUM_THREADS): two servers share this machine's two cores;
    # with torch's default (one per core each) their OpenMP threads spin against each other and
    # a 400-token chat turn took 8-17 s instead of 1.4-3.8 s on a 2-core machine at load ~9
    server_threads: int = 1
    sample_interval_s: float = 0.5  # the servers update their gauges once a second
    # (b)'s donor waits this long after a reclaim before it lends again
    # (--swiftcache-relend-cooldown-s; SwiftCache's default is 5 s). Its burst is one batch that
    # is over in a second, so 2 s is past it; the rounds wait for the relend (runner.py), so a
    # shorter cooldown is a shorter run, not a relend during another donor's burst
    relend_cooldown_s: float = 2.0
    settle_s: float = 6.0  # observed after the traffic: the last reclaim's relend, and after it
    busy_tp: int = 1  # every busy server's --tp (the donor stays at TP 1)

    def __post_init__(self) -> None:
        if self.relend_cooldown_s < 0 or self.settle_s < 0:
            raise ValueError("relend_cooldown_s and settle_s must not be negative")
        for name in ("busy_pool", "donor_pool", "conversations", "turns", "max_tokens",
                     "max_chars", "donor_conversations", "server_threads", "donor_requests",
                     "donor_max_tokens", "burst_requests", "burst_max_tokens", "burst_rounds",
                     "busy_tp"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.lend_fraction < 1 or not 0 < self.reclaim_watermark <= 1:
            raise ValueError("lend_fraction must be in (0, 1) and reclaim_watermark in (0, 1]")
        if not 0 < self.burst_fraction <= 1:
            raise ValueError(f"burst_fraction must be in (0, 1], got {self.burst_fraction}")

    @classmethod
    def quick(cls) -> "NodePlan":
        return replace(cls(), turns=4, donor_requests=16, settle_s=5.0)

    def check_busy_tp(self, busy: ModelFacts) -> None:
        """Raises ValueError, naming --busy-tp and the sizes that work, unless `busy_tp` splits
        the busy model's heads evenly (`ModelFacts.tp_sizes`)."""
        if self.busy_tp not in busy.tp_sizes():
            raise ValueError(
                f"--busy-tp {self.busy_tp}: the busy model {busy.name} has {busy.kv_heads} KV "
                f"heads and {busy.q_heads} query heads, which {self.busy_tp} ranks cannot split "
                f"evenly; use one of {busy.tp_sizes()}")

    def busy_env(self, cpus: int) -> dict[str, str]:
        """The busy server's extra environment: with `busy_tp` > 1, rank r bound to core
        r mod `cpus` (TP_BIND_ENV; only SGLang's CPU engine reads it)."""
        if self.busy_tp == 1:
            return {}
        return {TP_BIND_ENV: "|".join(str(r % max(1, cpus)) for r in range(self.busy_tp))}

    @property
    def busy_requests(self) -> int:
        """Busy requests of the steady phase (the reclaim phase adds `conversations` more)."""
        return self.conversations * self.turns

    @property
    def burst_tokens_each(self) -> int:
        return int(self.donor_pool * self.burst_fraction) // self.burst_requests

    def lendable_busy_tokens(self, busy: ModelFacts, donor: ModelFacts) -> int:
        """Busy-model tokens that the donor's lendable share holds (before packing waste)."""
        lent_bytes = int(self.donor_pool * self.lend_fraction) * donor.kv_bytes_per_token
        return lent_bytes // busy.kv_bytes_per_token

    @property
    def lent_donor_tokens(self) -> int:
        """Donor tokens an idle SwiftCache donor lends (`integration.lending.PoolLender`, with
        SGLang's CPU page of one token): its lend fraction of the pool, or less where its free
        room above the reserve and the headroom is smaller."""
        room = self.donor_pool - int(self.donor_pool * (1.0 - self.reclaim_watermark)) \
            - max(1, self.donor_pool // 16)
        return max(0, min(int(self.donor_pool * self.lend_fraction), room))

    def planned_loan(self, busy: ModelFacts, donor: ModelFacts) -> tuple[int, int]:
        """(busy tokens borrowed, donor tokens lent) in (b) before its traffic: the lent bytes
        packed into busy tokens (exact for one-token pages: the pack rule leaves less than one
        busy token unused), capped by the borrower's limit, `lendable_busy_tokens`. The ideal
        run (c) is sized by this and checked against what (b) moved (`runner.check_ideal`)."""
        lent = self.lent_donor_tokens
        packed = lent * donor.kv_bytes_per_token // busy.kv_bytes_per_token
        return min(packed, self.lendable_busy_tokens(busy, donor)), lent


@dataclass(frozen=True)
class RunSpec:
    """One run: which servers, with which pools."""

    key: str  # "a", "b", "c"
    name: str  # "stock", "swiftcache", "ideal"
    busy_pool: int
    donor_pool: int
    swiftcache: bool

    def busy_args(self, plan: NodePlan, rendezvous: str, max_borrow_blocks: int) -> list[str]:
        tp = ["--tp", str(plan.busy_tp)] if plan.busy_tp > 1 else []
        if not self.swiftcache:
            return [*COMMON_ARGS, *tp]
        return [*COMMON_ARGS, *tp, *HEARTBEAT_ARGS, "--swiftcache-rendezvous-dir", rendezvous,
                "--swiftcache-role", "borrower",
                "--swiftcache-max-borrow-blocks", str(max_borrow_blocks)]

    def donor_args(self, plan: NodePlan, rendezvous: str) -> list[str]:
        if not self.swiftcache:
            return list(COMMON_ARGS)
        return [*COMMON_ARGS, *HEARTBEAT_ARGS, "--swiftcache-rendezvous-dir", rendezvous,
                "--swiftcache-role", "donor",
                "--swiftcache-lend-fraction", str(plan.lend_fraction),
                "--swiftcache-reclaim-watermark", str(plan.reclaim_watermark),
                "--swiftcache-relend-cooldown-s", str(plan.relend_cooldown_s)]


def stock_run(plan: NodePlan) -> RunSpec:
    return RunSpec("a", "stock", plan.busy_pool, plan.donor_pool, swiftcache=False)


def swiftcache_run(plan: NodePlan) -> RunSpec:
    return RunSpec("b", "swiftcache", plan.busy_pool, plan.donor_pool, swiftcache=True)


def ideal_run(plan: NodePlan, max_borrowed_busy_tokens: int, max_lent_donor_tokens: int) -> RunSpec:
    """(c): what (b) moved, moved for good: the busy pool grows by the most it borrowed (its own
    tokens, after packing), the donor's shrinks by the most it lent (its tokens)."""
    if max_borrowed_busy_tokens < 0 or not 0 <= max_lent_donor_tokens < plan.donor_pool:
        raise ValueError(f"capacity moved in (b) out of range: borrowed "
                         f"{max_borrowed_busy_tokens}, lent {max_lent_donor_tokens} of "
                         f"{plan.donor_pool}")
    return RunSpec("c", "ideal", plan.busy_pool + max_borrowed_busy_tokens,
                   plan.donor_pool - max_lent_donor_tokens, swiftcache=False)
