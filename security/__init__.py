"""Mutual TLS, peer identities, payload sealing and the guards against hostile input.

See docs/security.md for the key model and the threat model.
"""
