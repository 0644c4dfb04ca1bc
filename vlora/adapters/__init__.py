"""Adapter generation: knowledge sources packed into the fewest LoRA adapters that keep every task's accuracy
(V-LoRA §4.2.1). See docs/adapters.md."""
