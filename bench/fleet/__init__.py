"""A discrete-event fleet simulator that drives the real router and autoscaling policy.

Replicas are models of an engine replica: the real `Scheduler` and `BlockManager` (prefix caching,
LRU eviction, the KV-event stream the router mirrors) over sequences that carry block hashes
instead of tokens, with each step's duration taken from a fitted cost model. The router under
test is `RouterState`, fed digests from the real `RoutingReporter` and called in the order the
ingress (`pagedserve.serve_app.engine_client`) calls it; the autoscaler is the real policy function fed
Ray Serve's window-averaged stats. `python -m bench.fleet --help`.
"""
