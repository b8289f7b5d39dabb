"""The daemon's ``http:`` config section: the OpenAI-compatible HTTP API (see :mod:`edgevlm.config`).

Off by default; when on it listens on 127.0.0.1 unless ``host`` says otherwise. Served by
:mod:`edgevlm.daemon.openai_api` (``pip install 'edgevlm[http]'``).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from edgevlm.validation import check_host

API_KEY_ENV = "EDGEVLM_HTTP_API_KEY"
"""Environment variable holding the bearer token when ``http.api_key_env`` is left at its default."""


class HttpConfig(BaseModel):
    """OpenAI-compatible HTTP API: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``."""

    model_config = ConfigDict(extra="forbid")

    enabled: StrictBool = Field(False, description="Serve the HTTP API.")
    host: StrictStr = Field(
        "127.0.0.1", min_length=1, description="Address to listen on (127.0.0.1 = this machine only; 0.0.0.0 = all)."
    )
    port: StrictInt = Field(8080, ge=0, le=65535, description="TCP port (0 = any free port, logged at start).")
    model_name: StrictStr | None = Field(
        None, min_length=1, max_length=256,
        description="Model id served in /v1/models and required in requests' 'model'; None = the model folder's name "
        "('edgevlm-demo' for the shipped demo model).",
    )
    api_key_env: StrictStr | None = Field(
        API_KEY_ENV, min_length=1,
        description="Environment variable holding the bearer token clients must send (Authorization: Bearer ...); "
        "when the variable is unset or empty no token is required. None = never require one.",
    )
    multiple_images: Literal["refuse", "last"] = Field(
        "refuse",
        description="A request with several images, for a model that answers about one: 'refuse' answers "
        "invalid_request_error naming the limit; 'last' answers about the last image (Frigate sends several "
        "frames of one tracked object, newest last).",
    )
    max_body_bytes: StrictInt = Field(
        16 * 1024 * 1024, ge=1024, le=1024**3,
        description="Largest request body accepted (bytes); a larger one is answered 413 without being read.",
    )

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return check_host(v)

    def api_key(self) -> str | None:
        """The bearer token clients must present, from the environment (None = none required)."""
        if self.api_key_env is None:
            return None
        return os.environ.get(self.api_key_env) or None

    def open_access_warning(self) -> str | None:
        """A one-line warning when the API will take requests without a token and that is likely a
        mistake: it listens beyond this machine (``host`` not a loopback address), or ``api_key_env``
        names a variable that is set but empty (an empty secret from a deployment tool); None otherwise."""
        if self.api_key() is not None:
            return None
        env = self.api_key_env
        why = ("http.api_key_env is null" if env is None
               else f"{env} is set but empty" if env in os.environ else f"{env} is not set")
        if not _is_loopback(self.host):
            return (f"HTTP API on {self.host} takes requests without a token from any host that reaches it ({why}); "
                    f"set {env or 'http.api_key_env'} to require 'Authorization: Bearer <token>'")
        if env is not None and env in os.environ:
            return f"HTTP API takes requests without a token: {why}"
        return None


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or name) is this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere
