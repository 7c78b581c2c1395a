"""The Ray-free engine: EngineCore's step loop over a Scheduler and an executor, its config, and the
offline API (`from engine.llm import LLM`).

Nothing is imported here, so `engine.config` loads without torch (the app's config and the ingress
need it; the model code they never run)."""
