"""Behaviour checks of the manifest (`touchpoints.How.BEHAVES`): small runs of the installed
SGLang (or the standard library) that show a touch point still behaves as SwiftCache relies on,
where a signature says too little. Each takes the resolved probe object and returns None when
it holds, else what differs. They run at start-up: CPU tensors and plain objects only.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def option_strings_index(container_init: Any) -> str | None:
    """argparse keeps every option string of a parser in `_option_string_actions`."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--probe-option")
    table = getattr(parser, "_option_string_actions", None)
    if not isinstance(table, dict) or "--probe-option" not in table:
        return "an ArgumentParser no longer lists its options in _option_string_actions"
    return None


def host_index_rule(move_indices: Any) -> str | None:
    """`host_tier.place_indices` places host and device indices as HiCache's controller does,
    for the io-backend/layout pairs whose indices stay on the CPU here."""
    import torch

    from .host_tier import place_indices

    host = torch.tensor([7, 2, 5, 0], dtype=torch.int64)
    dev = torch.tensor([10, 11, 12, 13], dtype=torch.int64)
    cpu = torch.device("cpu")
    for io, layout in (("kernel", "layer_first"), ("kernel", "page_first"),
                       ("direct", "layer_first"), ("direct", "page_first_direct")):
        controller = SimpleNamespace(io_backend=io, device=cpu,
                                     mem_pool_host=SimpleNamespace(layout=layout))
        want = move_indices(controller, host.clone(), dev.clone())
        got = place_indices(io, layout, cpu, host.clone(), dev.clone())
        if not all(torch.equal(w, g) for w, g in zip(want, got)):
            return f"HiCache places {io}/{layout} indices differently from host_tier.place_indices"
    return None


def running_request_reservation(offset: Any) -> str | None:
    """`lending.running_demand` reserves for a running request what `PrefillAdder` does."""
    from .lending import running_demand

    adder = SimpleNamespace(new_token_ratio=0.25)
    for max_new, done, ignore_eos in ((100, 10, False), (100, 10, True), (1 << 20, 3, False),
                                      (64, 64, False)):
        req = SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=max_new,
                                                              ignore_eos=ignore_eos),
                              output_ids=[0] * done)
        want, got = offset(adder, req), running_demand(req, adder.new_token_ratio)
        if abs(want - got) > 1e-9:
            return (f"PrefillAdder reserves {want} tokens for a running request where "
                    f"lending.running_demand counts {got}")
    return None


def request_tree_lock(req_class: Any) -> str | None:
    """A new request holds its tree lock and matched node at `.lock` and `.last_node`."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = req_class("probe", "", [1], SamplingParams(max_new_tokens=1))
    missing = [name for name in ("lock", "last_node") if not hasattr(req, name)]
    return f"a request no longer has {', '.join(missing)}" if missing else None


def idle_sleeper_poller(sleeper_class: Any) -> str | None:
    """An idle sleeper keeps one `zmq.Poller` at `.poller`, which other sockets can join."""
    import zmq

    sleeper = sleeper_class([])
    if not isinstance(getattr(sleeper, "poller", None), zmq.Poller):
        return "IdleSleeper no longer keeps its zmq.Poller at .poller"
    return None
