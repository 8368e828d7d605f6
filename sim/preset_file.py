"""A step-time preset as a YAML file: what `sluice calibrate` and bench/gpu_profile.py write
and what `--preset-file` reads.

The file holds one :class:`~sim.step_time.StepTimeModel`: the step-time coefficients, the
engine's sizes, and its provenance (measured where and how, with the fit's quality, or
from datasheets). Reading is strict (unknown keys, wrong types and impossible values are
refused naming the key); writing is atomic (a temporary file renamed over the target), so a
run that fails leaves no half-written preset.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scheduler.config import ConfigError, load_yaml_text

from scheduler.config_reading import format_validation_errors
from sim.step_time import Provenance, StepTimeModel

NonNegative = Annotated[float, Field(ge=0.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Provenance(_Strict):
    kind: Literal["datasheet", "measured"]
    where: Annotated[str, Field(min_length=1)]
    how: Annotated[str, Field(min_length=1)]
    r_squared: Annotated[float, Field(le=1.0)] | None = None
    max_relative_error: NonNegative | None = None
    samples: Annotated[int, Field(ge=1)] | None = None


class _PresetFile(_Strict):
    name: Annotated[str, Field(min_length=1)]
    description: str = ""
    provenance: _Provenance
    base_s: NonNegative
    prefill_token_s: NonNegative
    seq_s: NonNegative
    context_token_s: NonNegative
    # optional: files written before the model priced prefill attention leave it out (0)
    prefill_attention_s: NonNegative = 0.0
    kv_capacity_tokens: Annotated[int, Field(ge=1)]
    block_size: Annotated[int, Field(ge=1)] = 16
    max_num_seqs: Annotated[int, Field(ge=1)] = 256
    max_num_batched_tokens: Annotated[int, Field(ge=1)] = 8192
    kv_bytes_per_token: Annotated[int, Field(ge=0)] = 0
    suggested_host_tier_gib: NonNegative = 0.0
    host_link_bytes_per_s: NonNegative = 0.0


def read_preset_file(path: Path) -> StepTimeModel:
    """The preset in ``path``; :class:`ConfigError` naming the file and each bad key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the preset file: {err.strerror}") from None
    data = load_yaml_text(text, str(path))
    try:
        parsed = _PresetFile.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{path}: not a preset file:\n{format_validation_errors(err, '')}") from None
    keys = parsed.model_dump(exclude={"provenance"})
    return StepTimeModel(**keys, provenance=Provenance(**parsed.provenance.model_dump()))


def write_preset_file(model: StepTimeModel, path: Path) -> None:
    """Write ``model`` to ``path`` at once (nothing half-written if this fails)."""
    document = {name: getattr(model, name) for name in _PresetFile.model_fields
                if name != "provenance"}
    document["provenance"] = {key: value for key, value in dataclasses.asdict(model.provenance).items()
                              if value is not None}
    _PresetFile.model_validate(document)  # what is written is what reading accepts
    text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
