"""Generated gRPC stubs for the geodiloco.v1 protocol (see scripts/gen_protos.sh)."""
