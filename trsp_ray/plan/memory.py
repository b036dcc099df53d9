"""The units and pieces every memory plan is made of: GB, the fixed overheads, one stage's parts
(`StagePlan`) and what a plan of any route reads off its stages (`Peaks`)."""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1024**3
ADAM_FP32 = 12  # fp32 master copy + two Adam moments, bytes per trained parameter
REDUCE_BUCKET = 5e8  # DeepSpeed's default reduce_bucket_size (elements)
MAX_LIVE_PARAMETERS = 1e9  # DeepSpeed's default stage3_max_live_parameters (elements)
OVERHEAD_GB = {"gpu": 2.0, "cpu": 1.0}
# Host memory of one worker process besides offloaded state: Python, torch, DeepSpeed, the CUDA
# context's host side and the pinned staging buffers on GPU; measured ~1 GiB per CPU worker here.
HOST_BASE_GB = {"gpu": 6.0, "cpu": 1.0}
SINGLE_OVERHEAD_GB = {"gpu": 1.5, "cpu": 0.8}  # CUDA context + allocator slack; Python + torch + transformers


@dataclass
class StagePlan:
    name: str
    parts: dict[str, float] = field(default_factory=dict)  # GB per worker on the device
    host: float = 0.0  # GB per worker moved to host memory by offload

    @property
    def total(self) -> float:
        return sum(self.parts.values())


class Peaks:
    """What a plan of any route reads off its stages: the largest one and its size."""

    stages: tuple[StagePlan, ...]

    @property
    def peak(self) -> float:
        return self.worst().total

    def worst(self) -> StagePlan:
        return max(self.stages, key=lambda st: st.total)
