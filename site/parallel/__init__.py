"""Parallel layouts inside a site: meshes, DDP/FSDP2/TP/EP plans, pipeline stages, checkpoints."""
