"""Operator and developer tools: the demo, the local server launcher, the tiny model builder, and
`ctl` (the node's agents and leases). None of these run inside an SGLang server."""
