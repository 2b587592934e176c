"""Workloads built from real data: ShareGPT multi-turn conversations (see sharegpt.py)."""
