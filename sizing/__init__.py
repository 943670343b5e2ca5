"""hybridkv.sizing: torch-free model geometry, GPU catalog, byte model per rank, allocators, simulation and the planner."""
