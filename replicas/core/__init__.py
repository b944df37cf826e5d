"""The control plane, pure Python (neither torch nor ray): requests and sequences, the token-budget
scheduler, paged KV blocks with their hash-chained prefix cache, and the records a step leaves in."""
