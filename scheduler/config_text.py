"""Reading a configuration's text: YAML parsing and the error every config problem raises.

Kept apart from scheduler/config.py (which re-exports both) so that the typed sections there
have room; nothing here knows a policy.
"""

from __future__ import annotations

from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names every offending key."""


def load_yaml_text(text: str, source: str) -> Any:
    """Parse YAML, turning syntax errors into a :class:`ConfigError` naming ``source``."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from None
    except RecursionError:
        # PyYAML composes and constructs nodes recursively, so a document nested deeper than
        # the interpreter's stack (e.g. ``[[[[...]]]]`` ~1,000 levels) would escape as a crash
        # of check-config or a 500 from a reload instead of a config problem.
        raise ConfigError(f"{source}: not valid YAML: nested too deeply to parse") from None
