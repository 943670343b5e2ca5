"""hybridkv.api: the gRPC contract (hybridkv/v1), its generated stubs and a torch-free client."""
