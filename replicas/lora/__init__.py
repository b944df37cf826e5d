"""LoRA adapters on the base model: read and check PEFT adapters (adapter.py), map them onto the
model's projections (targets.py), keep them in a fixed pool of slots the step's rows index
(slots.py), and load, cache and place them (manager.py)."""
