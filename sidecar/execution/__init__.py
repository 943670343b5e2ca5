"""Execution: the model runner (flat batch tensors, CUDA graphs) and the tensor-parallel workers."""
