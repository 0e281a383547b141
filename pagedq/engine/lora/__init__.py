"""LoRA adapters per request: PEFT folders read from disk (adapter.py), a host cache and registry (manager.py),
device slots (slots.py for who holds which, layers.py for the stacked weights the adapted linears apply).
docs/engine.md#lora-adapters."""
