"""hybridkv.kernels: Triton kernels for GDN decode/prefill, causal conv1d and paged attention, each with a plain-torch reference."""
