"""Test tiers (pytest markers):

- unit (no marker): plain tensors and in-process objects; seconds in all.
- ``integration``: real gRPC servers and clients over loopback, real torch.distributed
  process groups (gloo) in real processes.
- ``slow``: long end-to-end runs (many processes, many rounds); run in CI too.

Select with ``-m "not slow"`` for a quick loop; CI runs everything.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
