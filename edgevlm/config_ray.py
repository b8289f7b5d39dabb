"""The daemon config's ``ray:`` section: ``edgevlm serve-ray`` (see :mod:`edgevlm.daemon.ray_serve`).

Only read by ``serve-ray``; ``edgevlm serve`` ignores it. The model is the config's ``model:``, the
HTTP front end its ``http:`` (host, port, model name, token), the limits and defaults its own.
"""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from edgevlm.protocol import check_pool
from edgevlm.validation import check_host


class RayConfig(BaseModel):
    """Replicas of the engine under Ray Serve: one per GPU on CUDA, fractional CPUs on a CPU."""

    model_config = ConfigDict(extra="forbid")

    address: StrictStr | None = Field(
        None, description="Ray cluster to join ('auto', 'ray://host:10001'); None = start a local Ray instance."
    )
    min_replicas: StrictInt = Field(1, ge=0, le=4096, description="Replicas kept running (autoscaling floor).")
    max_replicas: StrictInt | None = Field(
        None, ge=1, le=4096,
        description="Autoscaling ceiling; None = the cluster's GPUs for a CUDA model (at least 1), min_replicas on CPU.",
    )
    target_ongoing_requests: StrictFloat | StrictInt = Field(
        2, gt=0, le=1024, description="Autoscaling target: requests in flight per replica (queue depth).",
    )
    max_ongoing_requests: StrictInt = Field(
        8, ge=1, le=4096, description="Requests a replica accepts at once; more wait in Ray's router."
    )
    num_cpus_per_replica: StrictFloat | StrictInt = Field(
        1.0, gt=0, le=1024, description="CPUs reserved per replica (fractions allowed: 0.5 packs two per core)."
    )
    num_gpus_per_replica: StrictFloat | StrictInt | None = Field(
        None, ge=0, le=64, description="GPUs per replica; None = 1 for a CUDA model, 0 on CPU."
    )
    request_retries: StrictInt = Field(
        3, ge=0, le=100,
        description="Times a request whose replica died is sent to another replica (within its deadline).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> RayConfig:
        if self.max_replicas is not None and self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"max_replicas: {self.max_replicas} is below min_replicas {self.min_replicas}")
        if self.target_ongoing_requests > self.max_ongoing_requests:
            # a replica never holds more than max_ongoing_requests, so its load never reaches the target
            # and the autoscaler never adds a replica: the extra requests only queue in Ray's router
            raise ValueError(f"target_ongoing_requests: {self.target_ongoing_requests} is above max_ongoing_requests "
                             f"{self.max_ongoing_requests} (a replica never reaches it, so autoscaling never adds "
                             "one)")
        return self


class OffloadConfig(BaseModel):
    """Edge-to-pool offload (:mod:`edgevlm.daemon.offload`): requests this daemon cannot serve in
    time, or that name a model it does not have, are answered by a pool of daemons instead."""

    model_config = ConfigDict(extra="forbid")

    pool: StrictStr | None = Field(None, min_length=1, description="Pool to forward to (mqtt.pool of its members); None = off.")
    host: StrictStr | None = Field(
        None, min_length=1,
        description="Broker the pool's requests go to; None = mqtt.host (one broker, or an edge broker bridged "
        "to the cloud broker).",
    )
    port: StrictInt | None = Field(None, ge=1, le=65535, description="Its port; None = mqtt.port.")
    on_budget_miss: bool = Field(
        True, strict=True,
        description="Forward a request when even the cheapest operating point is predicted to miss its budget.",
    )
    on_unknown_model: bool = Field(
        True, strict=True, description="Forward a request whose 'model' is not the model this daemon serves."
    )
    margin_ms: StrictInt = Field(
        30, ge=0, le=600000,
        description="Taken off the request's budget and timeout for the extra hop before they are forwarded.",
    )
    max_in_flight: StrictInt = Field(32, ge=1, le=4096, description="Forwarded requests waiting at once; more are refused as today.")

    @field_validator("pool")
    @classmethod
    def _pool(cls, v: str | None) -> str | None:
        return check_pool(v) if v is not None else v

    @field_validator("host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        return check_host(v) if v is not None else v
