"""Operator view of the donation control channel, in the spirit of kvcached's ``kvctl``.

    python -m sglang_swift.ctl status [--rendezvous-dir DIR] [--secret-file FILE] [--json]
    python -m sglang_swift.ctl sweep [--rendezvous-dir DIR]

`status` lists every agent published in the rendezvous directory with its lending state (peers
it suspects are counted apart), then every lease (donor, borrower, blocks, blocks being
reclaimed). Each agent is asked over its own endpoint with an authenticated StatusRequest, so
`ctl` needs to read the node secret. `sweep` removes what killed servers of this user left on
the node (shared memory, sockets, records of processes that are gone); agents do it too when
they start and when they find a peer's process gone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import msgspec
import zmq

from sglang_swift.common.private_resources import sweep_shm
from sglang_swift.control import discovery
from sglang_swift.control import protocol as p
from sglang_swift.control.auth import read_secret
from sglang_swift.control.control_config import ControlConfigError, default_rendezvous_dir


def query(codec: p.Codec, rec: discovery.PeerRecord, timeout_s: float) -> p.AgentStatus | str:
    """One agent's status, or a short reason why there is none."""
    if not discovery.pid_alive(rec.pid):
        return "dead (stale record)"
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(rec.endpoint)
        env = p.Envelope(f"ctl-{os.getpid()}", 0, rec.epoch, 1, p.StatusRequest())
        sock.send(codec.encode(env))
        if not sock.poll(int(timeout_s * 1000)):
            return "no reply"
        reply = codec.decode(sock.recv())
    except p.BadMessage as err:
        return f"bad reply: {err.code}"
    finally:
        sock.close()
    if isinstance(reply.body, p.StatusReply):
        return reply.body.status
    if isinstance(reply.body, p.Error):
        return f"refused: {reply.body.code}"
    return "unexpected reply"


def _table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells)
    return "\n".join(line.rstrip() for line in lines)


def status(args) -> int:
    try:
        codec = p.Codec(
            read_secret(args.secret_file or os.path.join(args.rendezvous_dir, "secret"))
        )
    except FileNotFoundError as exc:
        print(
            f"no node secret at {exc.filename}: no agent has run with this rendezvous "
            "directory; pass --rendezvous-dir (and --secret-file) of the running servers",
            file=sys.stderr,
        )
        return 2
    except ControlConfigError as exc:
        print(f"cannot use the node secret: {exc}", file=sys.stderr)
        return 2
    records = sorted(discovery.read_records(args.rendezvous_dir), key=lambda r: r.agent_id)
    results = [(rec, query(codec, rec, args.timeout)) for rec in records]
    if args.json:
        print(
            json.dumps(
                [
                    msgspec.to_builtins(s)
                    if isinstance(s, p.AgentStatus)
                    else {"agent_id": r.agent_id, "epoch": r.epoch, "pid": r.pid, "state": s}
                    for r, s in results
                ]
            )
        )
        return 0
    agents, leases = [], {}
    for rec, st in results:
        if isinstance(st, str):
            agents.append([rec.agent_id, rec.epoch, rec.pid, rec.model, st] + ["-"] * 15)
            continue
        agents.append(
            [
                st.agent_id,
                st.epoch,
                st.pid,
                st.model,
                "up",
                st.num_blocks,
                st.lendable,
                st.reserve,
                st.lent,
                st.borrowed,
                *_capacity(st.capacity),
                _peers(st.peers),
            ]
        )
        for ls in st.leases:  # each lease is reported by both ends; the key dedups
            leases[(ls.donor, ls.epoch, ls.lease_id)] = ls
    print(f"rendezvous {args.rendezvous_dir}: {len(records)} agent(s)")
    print(
        _table(
            agents,
            [
                "AGENT",
                "EPOCH",
                "PID",
                "MODEL",
                "STATE",
                "BLOCKS",
                "LENDABLE",
                "RESERVE",
                "LENT",
                "BORROWED",
                "KV_POOL_TOK",
                "LENT_TOK",
                "BORROWED_TOK",
                "USABLE_TOK",
                "DONOR_TIER_TOK",
                "HOST_TIER_TOK",
                "HOST_CAP_TOK",
                "DONOR_HITS",
                "HOST_HITS",
                "PEERS",
            ],
        )
    )
    print(f"\n{len(leases)} lease(s)")
    print(
        _table(
            [
                [ls.donor, ls.borrower, ls.lease_id, ls.epoch, ls.num_blocks, ls.reclaiming]
                for ls in sorted(leases.values(), key=lambda ls: (ls.donor, ls.lease_id))
            ],
            ["DONOR", "BORROWER", "LEASE", "EPOCH", "BLOCKS", "RECLAIMING"],
        )
    )
    return 0


def _capacity(c: p.CapacityStatus | None) -> list:
    """The server's KV capacity in its own tokens; '-' for an agent without a server."""
    if c is None:
        return ["-"] * 9
    return [c.kv_pool_tokens, c.lent_tokens, c.borrowed_tokens, c.usable_tokens,
            c.donor_tier_tokens, c.host_tier_tokens, c.host_capacity_tokens, c.donor_hit_tokens,
            c.host_hit_tokens]


def _peers(peers: list[p.PeerStatus]) -> str:
    suspect = sum(q.suspect for q in peers)
    return f"{len(peers)} ({suspect} suspect)" if suspect else str(len(peers))


def sweep(args) -> int:
    removed = discovery.sweep(args.rendezvous_dir) + sweep_shm()
    print(f"removed {len(removed)} name(s) left by dead processes")
    for name in removed:
        print(f"  {name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sglang_swift.ctl", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="peers, leases, lent and borrowed blocks")
    st.add_argument("--rendezvous-dir", default=default_rendezvous_dir())
    st.add_argument("--secret-file", default="")
    st.add_argument("--timeout", type=float, default=0.5, help="seconds to wait per agent")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    sw = sub.add_parser("sweep", help="remove what killed servers left (shm, sockets, records)")
    sw.add_argument("--rendezvous-dir", default=default_rendezvous_dir())
    args = ap.parse_args(argv)
    return status(args) if args.command == "status" else sweep(args)


if __name__ == "__main__":
    sys.exit(main())
