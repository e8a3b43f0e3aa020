"""`python -m bench.run`: the gateway's throughput, latency and memory on this machine."""
