"""The memory planner's names in one namespace, for callers that use many of them (the tests,
`trsp-ray plan`). The package itself imports the module of each job:

    shape.py        parameter counts from the model on the meta device; the sizes of its config
    activations.py  what a forward keeps for backward, and a no-grad forward's one layer
    memory.py       GB, fixed overheads, a stage's parts
    zero3_setup.py  what a ZeRO-3 run's memory depends on, from a run config
    zero3_plan.py   per-worker memory of stage 1 and stage 2 under ZeRO-3; what would fit
    host_plan.py    checkpoints, disk, host memory and threads of a ZeRO-3 run
    single_plan.py  the stages of a run in one process on one device
    route.py        one process when it fits, else the fewest Ray Train workers
    plan_format.py  a ZeRO-3 plan as text
"""

from trsp_ray.distributed.host_plan import checkpoint_bytes
from trsp_ray.distributed.memory import GB, HOST_BASE_GB, OVERHEAD_GB
from trsp_ray.distributed.plan_format import format_plan
from trsp_ray.distributed.route import Route, route
from trsp_ray.distributed.shape import Shape, meta_model, read_shape, shape_from_config
from trsp_ray.distributed.single_plan import single_plan_for_run
from trsp_ray.distributed.zero3_plan import estimate, min_workers, plan, plan_for_run, zero3_plan
from trsp_ray.distributed.zero3_setup import Setup, setup_for_run

__all__ = ["GB", "HOST_BASE_GB", "OVERHEAD_GB", "Route", "Setup", "Shape", "checkpoint_bytes", "estimate",
           "format_plan", "meta_model", "min_workers", "plan", "plan_for_run", "read_shape", "route",
           "setup_for_run", "shape_from_config", "single_plan_for_run", "zero3_plan"]
