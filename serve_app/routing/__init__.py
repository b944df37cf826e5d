"""Prefix-cache-affinity routing: `router.PrefixAffinityRouter` (the Ray Serve RequestRouter) over
pure parts: `cache_mirror`, `prefix_index`, `load`, `policy`, `router_state`. Importing this
package pulls no Ray."""
