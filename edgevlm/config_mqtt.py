"""Broker and request sections of the daemon config: ``mqtt`` (with ``mqtt.tls``), ``defaults``
and ``limits`` (see :mod:`edgevlm.config`, which re-exports them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from edgevlm.protocol import (
    DEFAULT_PREFIX,
    MAX_NEW_TOKENS_LIMIT,
    NO_DEADLINE_MS,
    check_device_id,
    check_pool,
    check_prefix,
    default_device_id,
)
from edgevlm.validation import ConfigPath, StrictModel, check_host

MAX_FRONT_PROCESSES = 64
"""The most front processes ``mqtt.front_processes`` may ask for."""


class TlsConfig(StrictModel):
    """TLS towards the broker (paho's ``tls_set``)."""

    ca_certs: ConfigPath | None = Field(None, description="CA bundle (PEM); None = the system's trust store.")
    certfile: ConfigPath | None = Field(None, description="Client certificate (PEM) for mutual TLS.")
    keyfile: ConfigPath | None = Field(None, description="Client private key (PEM) for mutual TLS.")
    insecure: bool = Field(False, description="Skip the broker hostname check (testing only).")


class MqttConfig(StrictModel):
    """Broker connection and topic layout."""

    host: str = Field("localhost", min_length=1, description="Broker host name or IP address.")
    port: int = Field(1883, ge=1, le=65535,
                      description="Broker TCP port (an integer: 1883.0 and \"1883\" are refused).")
    prefix: str = Field(DEFAULT_PREFIX, description="Topic prefix: topics are <prefix>/<device_id>/...")
    device_id: str = Field(
        default_factory=default_device_id,
        description="This device's id (one topic level); default: hostname.",
    )
    client_id: str | None = Field(
        None,
        max_length=128,
        description="MQTT client id; None = 'edgevlm-daemon-<device_id>' (unique per device, stable across "
        "restarts).",
    )
    keepalive_s: int = Field(30, ge=5, le=65535, description="MQTT keepalive interval (s).")
    qos: Literal[0, 1, 2] = Field(1, description="QoS of the request subscription, responses and status.")
    username: str | None = Field(None, description="Broker user name.")
    password: str | None = Field(None, description="Broker password (needs username).")
    tls: TlsConfig | None = Field(None, description="TLS settings; None = plain TCP.")
    reconnect_min_delay_s: float = Field(
        1.0, gt=0, le=3600, description="First delay before reconnecting after the connection is lost (s)."
    )
    reconnect_max_delay_s: float = Field(
        30.0, gt=0, le=3600, description="Cap of the exponential reconnect backoff (s)."
    )
    max_payload_bytes: int = Field(
        16 * 1024 * 1024, gt=0, description="Larger request payloads are refused with INVALID_REQUEST."
    )
    session_expiry_s: int = Field(
        0,
        ge=0,
        le=4294967295,
        description="MQTT v5 Session Expiry Interval (s). 0 = a clean session on every connect; > 0 resumes "
        "the broker's session (Clean Start 0) on every connect, a restart of the daemon included: the "
        "request subscription and the QoS>=1 requests queued while the daemon was away are kept (across a "
        "broker restart too when the broker persists sessions; requests past their Message Expiry are "
        "dropped by the broker).",
    )
    pool: str | None = Field(
        None,
        description="Join this pool (one topic level): also take requests from <prefix>/pools/<pool>/request "
        "through an MQTT v5 shared subscription, so the broker hands each to one member; None = no pool.",
    )
    pool_group: str | None = Field(
        None, description="Shared-subscription group of the pool ($share/<group>/...); None = the pool name."
    )
    dedup_cache_size: int = Field(
        1024, ge=1, le=1_000_000, strict=True,
        description="Recent requests remembered by Response Topic + Correlation Data: a re-sent request "
        "is answered from this cache (or absorbed while it runs) instead of running twice.",
    )
    front_processes: int | Literal["auto"] = Field(
        "auto",
        description="MQTT front processes: 0 = off (one process does everything); N >= 1 starts N processes, "
        "each with its own broker connection in an MQTT v5 shared subscription on the request topics: they "
        "receive, validate and decode requests (inline images to uint8 pixels) and publish the answers, and "
        "the daemon's process only schedules and runs the model (a GPU daemon bound by one Python process). "
        "Client ids <client_id>-front<i>; a front that dies is restarted. 'auto' (the default): one front per "
        "4 host CPUs, at most 4, for a CUDA model with continuous batching (the cloud profiles) without "
        "offload.pool; else 0 (edgevlm.daemon.app.front_process_count).",
    )

    @field_validator("front_processes", mode="before")
    @classmethod
    def _front_processes(cls, v: object) -> object:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"give a count from 0 to {MAX_FRONT_PROCESSES} or 'auto', not {v!r}")
        if not 0 <= v <= MAX_FRONT_PROCESSES:
            raise ValueError(f"give a count from 0 to {MAX_FRONT_PROCESSES} or 'auto', not {v}")
        return v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        return check_prefix(v)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return check_host(v)

    @field_validator("device_id")
    @classmethod
    def _device_id(cls, v: str) -> str:
        return check_device_id(v)

    @field_validator("pool")
    @classmethod
    def _pool(cls, v: str | None) -> str | None:
        return check_pool(v) if v is not None else v

    @field_validator("pool_group")
    @classmethod
    def _pool_group(cls, v: str | None) -> str | None:
        return check_pool(v, what="pool_group") if v is not None else v

    @model_validator(mode="after")
    def _check(self) -> MqttConfig:
        if self.reconnect_max_delay_s < self.reconnect_min_delay_s:
            raise ValueError("reconnect_max_delay_s: must be >= reconnect_min_delay_s")
        if self.password is not None and self.username is None:
            raise ValueError("password: needs a username")
        if self.pool_group is not None and self.pool is None:
            raise ValueError("pool_group: needs a pool")
        return self

    @property
    def effective_client_id(self) -> str:
        return self.client_id or f"edgevlm-daemon-{self.device_id}"


class DefaultsConfig(StrictModel):
    """Values used when a request leaves a field out."""

    max_new_tokens: int = Field(32, gt=0, le=MAX_NEW_TOKENS_LIMIT, description="Cap on generated tokens.")
    timeout_ms: int = Field(
        30000, gt=0, le=NO_DEADLINE_MS, description=f"Request deadline (ms); {NO_DEADLINE_MS} = no deadline."
    )


class LimitsConfig(StrictModel):
    """Limits on what a request may make the daemon decode (``mqtt.max_payload_bytes`` caps the
    whole payload)."""

    max_image_bytes: int = Field(
        10 * 1024 * 1024, gt=0, description="Largest inline image file (bytes after base64); more is INVALID_IMAGE."
    )
    max_image_pixels: int = Field(
        4096 * 4096,
        gt=0,
        description="Largest inline image width x height, read from the file header before decoding "
        "(a decompression bomb is INVALID_IMAGE, never decoded).",
    )
