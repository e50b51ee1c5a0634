"""Test and rehearsal tools (the in-process link, process helpers): imported by tests and
benchmarks, never by the product (an import-linter contract)."""
