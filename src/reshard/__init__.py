"""reshard: move sharded JAX arrays between shardings, device sets and memory kinds.

The public surface is exactly what this module re-exports; everything else lives in
private ``reshard._*`` modules. See README.md for a tour and ../shared/DESIGN.md for the
architecture and vocabulary (box, shard, location, piece, plan, executor).
"""

from __future__ import annotations

__version__ = "0.1.0"

# --- core (issue 2) ---

# --- seed helpers: intermediate shardings, mesh-axis split/concatenate (issue 3) ---

# --- multi-controller (issue 4) ---

# --- elastic (issue 5) ---
