"""The hierarchy benchmark (scripts/bench_tiers.py): HiCache, HiCache with SwiftCache, the upper
bound."""
