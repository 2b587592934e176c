"""The node benchmark (`scripts/bench_node.py`): one node, two models, three runs of one traffic.

    plan.py     sizes, workload, the three runs' server arguments, FLOPs per KV byte
    traffic.py  the requests (ShareGPT chats for the busy model, light chats and a burst for the
                donor) and the async driver that sends them
    observe.py  Prometheus text parsing and the background sampler of the servers' capacity
    report.py   outputs compared to stock, cached tokens, TTFT tables, the JSON summary, the plot
    runner.py   one run: start both servers, wait for the lease, drive, sample, stop
    cli.py      the command line
"""
