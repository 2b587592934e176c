"""A discrete-event simulator of one multi-GPU node serving several models, SIMULATED numbers only.

It is a harness around the project's real prefix-cache bookkeeping (`radix_ext`): time, links and
compute are modeled here (clock.py, links.py, roofline.py, params.py); which tokens hit in which
tier, what gets evicted or demoted, is decided by the real trees through `cache_adapter.py`.
"""
