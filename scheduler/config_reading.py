"""Reading a policy section from data or YAML (scheduler/config.py defines the sections): the
union pydantic validates, discriminated by ``name``, and errors that name each offending key
by its dotted path."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag, TypeAdapter, ValidationError

from scheduler.config import DEFAULT_POLICY, POLICY_NAMES, PolicyConfig, section_class
from scheduler.config_types import ConfigError, load_yaml_text


def _policy_name(data: Any) -> str:
    if isinstance(data, dict):
        return data.get("name", DEFAULT_POLICY)
    return getattr(data, "name", DEFAULT_POLICY)


# A policy section as pydantic validates it: a union discriminated by ``name`` (absent: the
# default policy). Use it as a field's type; :func:`make_policy_config` validates a mapping.
AnyPolicyConfig = Annotated[
    Union[tuple(Annotated[section_class(name), Tag(name)] for name in POLICY_NAMES)],  # type: ignore[valid-type]
    Discriminator(_policy_name),
]


@functools.cache
def _adapter() -> TypeAdapter[PolicyConfig]:
    return TypeAdapter(AnyPolicyConfig)


def make_policy_config(data: dict[str, Any] | None = None) -> PolicyConfig:
    """Validate a mapping as the section its ``name`` chooses (pydantic's errors)."""
    name = _policy_name(data or {})
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return _adapter().validate_python(data or {})


def format_validation_errors(err: ValidationError, prefix: str) -> str:
    """One line per error, each naming its key by its dotted path under ``prefix``."""
    lines = []
    for item in err.errors():
        parts = item["loc"]
        if parts and parts[0] in POLICY_NAMES:
            parts = parts[1:]  # the union's tag: which section was read, not a key
        loc = ".".join(str(part) for part in parts)
        msg = item["msg"].removeprefix("Value error, ")
        if not loc:
            lines.append(f"{prefix}: {msg}" if prefix else msg)
        else:
            lines.append(f"{prefix + '.' if prefix else ''}{loc}: {msg}")
    return "\n".join(lines)


def parse_policy_config(data: Any, prefix: str = "policy") -> PolicyConfig:
    """Validate a mapping as the :class:`PolicyConfig` section its ``name`` chooses; errors
    name ``prefix.key``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(data).__name__}")
    name = data.get("name", DEFAULT_POLICY)
    if not isinstance(name, str) or name not in POLICY_NAMES:
        raise ConfigError(f"{prefix}.name: unknown policy {name!r}; choose from "
                          f"{', '.join(POLICY_NAMES)}")
    try:
        return make_policy_config(data)
    except ValidationError as err:
        raise ConfigError(format_validation_errors(err, prefix)) from None


def parse_policy_yaml(text: str, source: str = "<config>") -> PolicyConfig:
    """Read the ``policy:`` section of a Sluice YAML document (other sections are the shells')."""
    data = load_yaml_text(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return parse_policy_config(data.get("policy"), "policy")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
