"""Code that exists only for tests and benchmarks: a standalone control-channel peer process
(`control_peer`, driven over JSON lines by `peer_process.PeerProcess`) that lends or borrows a real
shared-memory arena without a model server. Nothing in the runtime imports this package."""
