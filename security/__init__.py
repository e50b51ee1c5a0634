"""Mutual TLS, peer identities, payload sealing and the guards against hostile input.

See the README's "Security" and "Threat model" sections for the key model.
"""
