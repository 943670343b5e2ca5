"""hybridkv.sidecar: the dual-pool inference engine and its gRPC server."""
