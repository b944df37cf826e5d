"""The engine replica's gauges and counters: their Ray metric names (Prometheus sees them with a
`ray_` prefix; the dashboards read those) and the exporter that sets them from the engine's stats.
"""
from __future__ import annotations

REPLICA_GAUGES = {
    "pagedserve_num_requests_waiting": ("num_waiting", "Requests waiting in the engine queue"),
    "pagedserve_num_requests_running": ("num_running", "Sequences running in the engine batch"),
    "pagedserve_kv_cache_usage": ("kv_cache_usage", "Fraction of KV-cache blocks in use"),
    "pagedserve_prefix_cache_hit_rate": ("prefix_cache_hit_rate",
                                         "Prompt tokens served from the prefix cache / queried"),
    # What the autoscaling policy reads (pagedserve.replicas.core.step_load, pagedserve.replicas.core.working_set)
    "pagedserve_compute_utilization": ("compute_utilization",
                                       "Share of the last seconds spent on per-token work"),
    "pagedserve_kv_working_set": ("kv_working_set",
                                  "Prompt blocks reused within a minute, in replicas' KV caches"),
    "pagedserve_lora_resident": ("lora_num_resident", "LoRA adapters held in memory"),
}
REPLICA_COUNTERS = {
    "pagedserve_num_preemptions": ("num_preemptions", "Sequences preempted (recomputed later)"),
    "pagedserve_engine_steps": ("num_steps", "Engine steps run"),
    "pagedserve_lora_loads": ("lora_loads", "LoRA adapters read into memory"),
    "pagedserve_lora_evictions": ("lora_evictions", "LoRA adapters dropped from memory (LRU)"),
    "pagedserve_lora_slot_loads": ("lora_slot_loads", "LoRA adapters copied into a batch slot"),
    # Speculative decoding, as vLLM's spec_decode counters: acceptance rate is accepted / draft
    # tokens, the mean tokens a verify yields 1 + accepted / drafts.
    "pagedserve_spec_decode_num_drafts": ("spec_decode_num_drafts",
                                          "Verify runs: a sequence with drafts in a step"),
    "pagedserve_spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",
                                                "Draft tokens proposed and verified"),
    "pagedserve_spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",
                                                   "Draft tokens accepted"),
}


class ReplicaMetrics:
    """One replica's exporter: `update(stats)` sets the gauges and advances the counters."""

    def __init__(self, replica_id: str):
        from ray.util.metrics import Counter, Gauge

        tags = ("replica",)
        self.tags = {"replica": replica_id}
        self.gauges = {key: Gauge(name, description, tag_keys=tags)
                       for name, (key, description) in REPLICA_GAUGES.items()}
        self.counters = {key: Counter(name, description, tag_keys=tags)
                         for name, (key, description) in REPLICA_COUNTERS.items()}
        self.last_counts: dict[str, float] = {}

    def update(self, stats: dict) -> None:
        for key, gauge in self.gauges.items():
            if key in stats:
                gauge.set(float(stats[key]), tags=self.tags)
        for key, counter in self.counters.items():
            if key in stats:
                increase = float(stats[key]) - self.last_counts.get(key, 0.0)
                if increase > 0:
                    counter.inc(increase, tags=self.tags)
                self.last_counts[key] = float(stats[key])
