"""edgevlm.validation: the one-line key-path messages every schema's errors are reported with."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from edgevlm.errors import ConfigError, ModelLoadError
from edgevlm.validation import first_error_message, read_json_model


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    port: int = Field(1883, ge=1, le=65535)


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mqtt: Inner = Field(default_factory=Inner)
    items: list[Inner] = Field(default_factory=list)
    name: str = "x"

    @model_validator(mode="after")
    def _check(self) -> Outer:
        if self.name == "bad":
            raise ValueError("name: must not be 'bad'")
        return self


def _message(data) -> str:
    with pytest.raises(ValidationError) as info:
        Outer.model_validate(data)
    return first_error_message(info.value)


def test_messages_start_with_the_key_path() -> None:
    assert _message({"mqtt": {"prot": 1}}) == "mqtt.prot: unknown key"
    assert _message({"items": [{}, {"port": 0}]}) == "items[1].port: Input should be greater than or equal to 1"
    assert _message({"name": "bad"}) == "name: must not be 'bad'"  # the model-level check names its key
    assert _message({"mqtt": {"prot": 1}, "bogus": 2}) == "mqtt.prot: unknown key (and 1 more)"


def test_missing_key_and_custom_words() -> None:
    class Needs(BaseModel):
        value: int

    with pytest.raises(ValidationError) as info:
        Needs.model_validate({})
    assert first_error_message(info.value) == "value: required key missing"
    assert first_error_message(info.value, missing="field required") == "value: field required"


def test_read_json_model(tmp_path) -> None:
    path = tmp_path / "x.json"
    with pytest.raises(ConfigError) as info:
        read_json_model(path, Outer, error=ConfigError)
    assert info.value.message == f"{path} not found"
    path.write_text("{nope")
    with pytest.raises(ModelLoadError, match=r"x\.json: not valid JSON \(Expecting property name"):
        read_json_model(path, Outer, error=ModelLoadError)
    path.write_text('{"mqtt": {"port": 0}}')
    with pytest.raises(ConfigError) as info:
        read_json_model(path, Outer, error=ConfigError, not_found="unused")
    assert info.value.message == f"{path}: mqtt.port: Input should be greater than or equal to 1"
    path.write_text('{"mqtt": {"port": 8883}}')
    assert read_json_model(path, Outer, error=ConfigError).mqtt.port == 8883
