"""LoRA adapters on the worker: reading PEFT files, stacked slot weights, batched application."""
