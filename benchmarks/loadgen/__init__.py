"""A reusable load generator for the router's OpenAI and gRPC APIs (the code behind ``pdcluster bench``).

    workload.make_workload(...)   -> list[RequestSpec]       what to send (lengths, prefixes, chat vs long)
    clients.OpenAIClient / GrpcClient .send(spec) -> RequestResult   one request, with token timestamps
    runner.run_load(client, specs, LoadShape(...)) -> RunResult      closed loop or open-loop Poisson, bounded
    stats.summarize(results, wall_s, Slo(...)) -> dict               TTFT/ITL/TPOT/e2e, throughput, goodput, errors
    plots.write_plots(results, out_prefix)                           latency CDFs and ITL over time (PNG)
"""
