"""The model: Qwen3.5/3.6 text stacks, their layers, the checkpoint loader and the tokenizer; reads a BatchContext
and knows nothing of requests."""
