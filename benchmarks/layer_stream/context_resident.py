"""bench_context with resident rows (`--resident-fraction`): the streamed pool whose local KV
memory is at most the stock pool's, the check of it against the server's log, and the short
request that fits in the resident slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .context_servers import logged_resident_tokens, streamed_pool_log

if TYPE_CHECKING:
    from .context_bench import Setup


@dataclass(frozen=True)
class ResidentPlan:
    """A streamed pool with resident rows whose local KV memory is at most a stock pool's."""

    fraction: float
    tokens: int  # N: the pool (--max-total-tokens)
    resident: int  # R: resident slots, rounded as the pool rounds them
    local_rows: int  # layer-rows of K (and as many of V) in local memory: L R + D (mapped - R)

    @classmethod
    def fit(cls, setup: Setup, fraction: float, kv_row_bytes: int, granularity: int = 4096,
            page_size: int = 1) -> "ResidentPlan":
        """The largest pool N whose local memory (as `LayerStreamKVPool` lays it out for K rows
        of `kv_row_bytes`, mapped in units of `granularity` bytes; 4 KiB pages on CPU) is at
        most the stock pool's `L (P + 1)` rows."""
        budget = setup.layers * (setup.pool + 1)
        tokens = int((fraction + (1 - fraction) * setup.layers / setup.depth)
                     * (setup.pool + 1)) - 1
        while tokens > 0:
            plan = cls.of(setup, fraction, tokens, kv_row_bytes, granularity, page_size)
            if plan.local_rows <= budget:
                return plan
            tokens -= 1
        raise ValueError(f"no streamed pool fits the local memory of a {setup.pool}-token pool")

    @classmethod
    def of(cls, setup: Setup, fraction: float, tokens: int, kv_row_bytes: int,
           granularity: int = 4096, page_size: int = 1) -> "ResidentPlan":
        """The local memory of a pool of `tokens` (laid out by `StreamSettings.resident_split`,
        as the pool does), in rows."""
        from sglang_swift.layer_stream.pool import StreamSettings

        settings = StreamSettings(depth=setup.depth, resident_fraction=fraction)
        resident, mapped = settings.resident_split(tokens, setup.layers, page_size, kv_row_bytes,
                                                   granularity)
        if resident <= 0:  # the pool streams every row
            return cls(fraction, tokens, 0, setup.depth * mapped)
        return cls(fraction, tokens, resident,
                   setup.layers * resident + setup.depth * (mapped - resident))


def check_resident_pool(plan: ResidentPlan, setup: Setup, log: str, row_bytes: int) -> None:
    """The streamed server's pool is `plan`'s (its N and R, as logged) and its local KV memory,
    computed and logged (to 0.1 MiB), is at most the stock pool's."""
    pool_log, resident = streamed_pool_log(log), logged_resident_tokens(log)
    stock_mib = setup.layers * (setup.pool + 1) * row_bytes / 2**20
    if (pool_log["tokens"], resident) != (plan.tokens, plan.resident):
        raise RuntimeError(f"the streamed server's pool ({pool_log['tokens']} tokens, {resident} "
                           f"resident) is not the planned {plan}")
    if plan.local_rows * row_bytes / 2**20 > stock_mib or pool_log["local_mib"] > stock_mib + 0.05:
        raise RuntimeError(f"the streamed server's local KV memory ({pool_log['local_mib']} MiB "
                           f"logged) exceeds the stock pool's {stock_mib:.2f} MiB")
    if short_prompt_len(plan.resident, setup.decode_steps) < 1:
        raise RuntimeError(f"{plan.resident} resident tokens hold no short request with "
                           f"{setup.decode_steps} decode steps; use a larger --pool")


def short_prompt_len(resident: int, decode_steps: int) -> int:
    """R/2 tokens, fewer if the output would not fit in the R resident slots as well."""
    return min(resident // 2, resident - decode_steps - 2)
