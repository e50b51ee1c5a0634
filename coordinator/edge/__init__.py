"""The coordinator's gRPC edge: the server and the servicers that translate messages to the core and back."""
