"""Multi-turn load generator for SGLang-compatible servers.

  cli.py           scripts/bench_sessions.py: chat sessions, agent tool loops, agent programs
  runner.py        replays text sessions (Poisson starts, turns in order, think times)
  client.py        streaming /generate and /v1/chat/completions clients (TTFT, ITL, cached tokens)
  frontend.py      an agent written in SGLang's frontend language, run through RuntimeEndpoint
  sglang_tools.py  SGLang's own benchmarks (sglang.benchmark.serving, bench_multiturn.py), offline
  stats.py, plots.py  percentiles, per-turn hit rates, PNG plots
"""
