"""reshard: move sharded JAX arrays between shardings, device sets and memory kinds.

The public surface is exactly what this module re-exports; everything else lives in
private ``reshard._*`` modules. README.md ("What it does") gives a tour and the
vocabulary (box, shard, location, piece, plan, executor); docs/ covers the command
line, multi-process runs and elastic training.
"""

__version__ = "0.1.0"

# --- core (issue 2) ---
from ._api import clear_plan_cache as clear_plan_cache
from ._api import plan as plan
from ._api import reshard as reshard
from ._buffers import release_host_buffers as release_host_buffers
from ._errors import DataLossError as DataLossError
from ._plan import Plan as Plan
from ._planner import PlanStats as PlanStats

# --- seed helpers: intermediate shardings, mesh-axis split/concatenate (issue 3) ---
from ._intermediate import INTERMEDIATE_REPLICA_SUFFIX as INTERMEDIATE_REPLICA_SUFFIX
from ._intermediate import INTERMEDIATE_SPLIT_SUFFIX as INTERMEDIATE_SPLIT_SUFFIX
from ._intermediate import NoIntermediateShardingError as NoIntermediateShardingError
from ._intermediate import (
    NoIntermediateShardingNeededError as NoIntermediateShardingNeededError,
)
from ._intermediate import find_intermediate_sharding as find_intermediate_sharding
from ._intermediate import (
    reshard_with_intermediate_sharding as reshard_with_intermediate_sharding,
)
from ._split import concatenate_by_mesh_axis as concatenate_by_mesh_axis
from ._split import split_by_mesh_axis as split_by_mesh_axis

# --- multi-controller (issue 4) ---
from ._launch import LaunchError as LaunchError
from ._launch import ProcessResult as ProcessResult
from ._launch import initialize_from_env as initialize_from_env
from ._launch import launch_local as launch_local

# --- elastic (issue 5) ---
from ._elastic import DeviceLossError as DeviceLossError
from ._elastic import ElasticEvent as ElasticEvent
from ._elastic import ElasticManager as ElasticManager
from ._elastic import parse_lost_devices as parse_lost_devices
from ._elastic import recover as recover
from ._mesh_surgery import carry_shardings as carry_shardings
from ._mesh_surgery import grow_mesh as grow_mesh
from ._mesh_surgery import shrink_mesh as shrink_mesh

# Pathways has these two helpers as modules of the same name, and its users call
# ``split_by_mesh_axis.split_by_mesh_axis(...)`` (after ``from pathwaysutils.experimental
# import split_by_mesh_axis``, as tunix does): the same call works here.
split_by_mesh_axis.split_by_mesh_axis = split_by_mesh_axis  # type: ignore[attr-defined]
concatenate_by_mesh_axis.concatenate_by_mesh_axis = concatenate_by_mesh_axis  # type: ignore[attr-defined]

# Newer Pathways releases add variants over their side-channel transport; here every
# move uses JAX's own transports, so they are the same calls.
sidechannel_reshard = reshard
sidechannel_reshard_with_intermediate_sharding = reshard_with_intermediate_sharding
