"""The detour.v1 message classes under short names: detour.pb.JobSpec, ...

For building specs as messages instead of dicts:

    spec = detour.pb.JobSpec(name="tiny", iterations=10,
                             model=detour.pb.ModelShape(preset="tiny"))
"""

from detour._proto.detour.v1.job_service_pb2 import (  # noqa: F401
    Job, JobEvent, JobHistoryEvent, JobProgress, JobState)
from detour._proto.detour.v1.spec_pb2 import (  # noqa: F401
    AdamWSpec, CheckpointPolicy, DataSourceKind, DataSpec, ElasticSpec, GradNormalization,
    JobSpec, KfacPlacement, KfacSpec, KfacUpdate, ModelShape, OptimizerKind, OptimizerSpec,
    PipelineSpec, PlanObjective, QueuePolicy, SchedulerKind, StageNodes)
from detour._proto.detour.v1.control_service_pb2 import WorkerInfo, WorkerState  # noqa: F401

__all__ = [
    "Job", "JobEvent", "JobHistoryEvent", "JobProgress", "JobState",
    "AdamWSpec", "CheckpointPolicy", "DataSourceKind", "DataSpec", "ElasticSpec",
    "GradNormalization", "JobSpec", "KfacPlacement", "KfacSpec", "KfacUpdate", "ModelShape",
    "OptimizerKind", "OptimizerSpec", "PipelineSpec", "PlanObjective", "QueuePolicy",
    "SchedulerKind", "StageNodes", "WorkerInfo", "WorkerState",
]
