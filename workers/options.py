"""Names that configs validate against, kept free of torch so configs can import them anywhere."""

DTYPE_NAMES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "flash_attn", "triton")
DEFAULT_CACHE_DIR = "~/.cache/raylm"
QUANTIZATIONS = ("auto", "gguf", "none", "fp8")
STEP_TRANSPORTS = ("socket", "compiled_graph", "actor_calls")
KV_CACHE_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: E4M3 codes (workers/kv_fp8.py)
