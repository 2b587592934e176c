"""The donation control channel: discovery, leases, reclaim, heartbeats and authentication
between SwiftCache servers on one node. Imports neither SGLang nor torch.

Start with :class:`ControlAgent` (agent.py); wire messages live in protocol.py.
"""

from sglang_swift.control.agent import ControlAgent
from sglang_swift.control.config import ControlConfig, ControlConfigError
from sglang_swift.control.events import (BlocksReturned, LeaseGranted, LeaseKey, LeaseLost,
                                         PeerChanged, ReclaimRequested, RequestFailed)
from sglang_swift.control.protocol import MemoryDescriptor

__all__ = ["ControlAgent", "ControlConfig", "ControlConfigError", "MemoryDescriptor",
           "LeaseKey", "LeaseGranted", "RequestFailed", "ReclaimRequested", "LeaseLost",
           "BlocksReturned", "PeerChanged"]
