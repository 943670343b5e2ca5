"""Serving: the gRPC server, the engine process it drives, and the `serve` command line."""
