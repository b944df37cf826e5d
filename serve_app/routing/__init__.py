"""Prefix-cache-affinity routing, the ingress's (`pagedserve.serve_app.engine_client` drives it): pure parts,
`cache_mirror`, `prefix_index`, `load`, `policy`, `router_state`; `metrics` exports its decisions."""
