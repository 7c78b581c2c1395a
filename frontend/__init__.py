"""The tokenizer side of generation, shared by the OpenAI ingress and the offline LLM: prompts
encoded one way, incremental detokenization, stop strings. No Ray, no model code."""
