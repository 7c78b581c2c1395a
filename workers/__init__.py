"""Model execution: the Llama family, tensor-parallel layers, paged attention, loader, runner."""
