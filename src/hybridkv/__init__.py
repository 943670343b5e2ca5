"""hybridkv: serve hybrid Gated DeltaNet + attention LLMs with a dual-pool KV cache and honest capacity."""

__version__ = "0.1.0"
