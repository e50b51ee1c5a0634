"""The outer loop: rounds, aggregation, the outer optimizer, and its gRPC service."""
