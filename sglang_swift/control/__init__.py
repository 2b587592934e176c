"""The donation control channel: discovery, leases, reclaim, heartbeats and authentication
between SwiftCache servers on one node. Imports neither SGLang nor torch.

Map of the package:
  agent.py     ControlAgent, the owner-facing API and its state (start here);
               agent_io.py its I/O thread's step and what the sides call on that thread
  protocol.py  every wire message (msgspec structs, msgpack, HMAC-signed frames)
  peers.py     membership: hello, heartbeats, dispatch; status.py the operator view
  liveness.py  suspicion and death of peers, lease re-validation (docs/liveness.md)
  donor.py / ledger.py / grant_policy.py   lending: bookkeeping and the named grant policies
  borrower.py  borrowing: held leases, read deadlines, reclaim acknowledgements
  link.py      ZMQ sockets; discovery.py rendezvous records; auth.py the node secret
  control_config.py  ControlConfig; events.py what the owner receives
(A standalone agent process for tests and benchmarks lives in `benchmarks.peers`.)

Invariants: a donor hands a reclaimed block back to its owner only after the borrower
acknowledged (or released) it, or was declared dead; a peer is declared dead only when its
process is gone, its socket closed, or it was silent for the long ``dead_after_s``, never for a
pause alone; a borrower reads only before its read deadline, which ends before any donor could
declare it dead, and a deadline that passed is re-validated with the donor, not taken as loss;
epochs make messages from or to an earlier incarnation inert; the owner's demand always wins
over lending.
"""

from sglang_swift.control.agent import ControlAgent
from sglang_swift.control.control_config import ControlConfig, ControlConfigError
from sglang_swift.control.events import (
    BlocksReturned,
    LeaseGranted,
    LeaseKey,
    LeaseLost,
    PeerChanged,
    ReclaimRequested,
    RequestFailed,
)
from sglang_swift.control.protocol import MemoryDescriptor

__all__ = [
    "ControlAgent",
    "ControlConfig",
    "ControlConfigError",
    "MemoryDescriptor",
    "LeaseKey",
    "LeaseGranted",
    "RequestFailed",
    "ReclaimRequested",
    "LeaseLost",
    "BlocksReturned",
    "PeerChanged",
]
