"""The node benchmark (`scripts/bench_node.py`): one node, two models, three runs of one traffic.

    plan.py     sizes, workload, the three runs' server arguments, FLOPs per KV byte
    traffic.py  the requests (ShareGPT chats for the busy model, light chats and a burst for the
                donor) and the async driver that sends them
    observe.py  Prometheus text parsing and the background sampler of the servers' capacity
    report.py   outputs compared to stock, cached tokens, TTFT tables, the JSON summary, the plot
    runner.py   one run: start both servers, wait for the lease, drive, sample, stop
    cli.py      the command line
The rate sweep (`scripts/bench_rate.py`: P99 TTFT against session rate on the same two models):
    rates.py        sessions, Poisson arrivals, how a rate point is judged (stable, drained)
    rate_driver.py  every system's servers started once, one rate point driven and judged
    rate_cli.py     the command line, table, plot and JSON line
"""
