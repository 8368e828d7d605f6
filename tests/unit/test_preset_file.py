"""Preset files (sim/preset_file.py): what is written is read back the same; what is wrong is
refused naming the key; nothing half-written."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from scheduler.config import ConfigError
from sim.preset_file import read_preset_file, write_preset_file
from sim.step_time import Provenance, preset

MEASURED = Provenance("measured", "vLLM 0.32 CPU, tiny Qwen2, 2 cores", "sluice calibrate --worker ...",
                      r_squared=0.991, max_relative_error=0.07, samples=40)


def test_a_preset_comes_back_as_it_was_written(tmp_path):
    model = dataclasses.replace(preset("llama3.1-8b-h100"), name="my-h100", prefill_attention_s=4.5e-8,
                                provenance=MEASURED)
    path = tmp_path / "presets" / "my.yaml"
    write_preset_file(model, path)
    assert read_preset_file(path) == dataclasses.replace(model, kv_offload_gib=0.0)
    assert [p.name for p in path.parent.iterdir()] == ["my.yaml"]  # no temporary left behind


def test_a_datasheet_preset_says_so_in_its_file(tmp_path):
    path = tmp_path / "p.yaml"
    write_preset_file(preset("llama3.1-8b-h200"), path)
    assert "kind: datasheet" in path.read_text() and read_preset_file(path).provenance.kind == "datasheet"


def test_a_file_written_before_the_prefill_attention_term_reads_with_it_at_zero(tmp_path):
    path = tmp_path / "older.yaml"
    model = dataclasses.replace(preset("llama3.1-8b-h100"), name="older", provenance=MEASURED)
    write_preset_file(model, path)
    document = yaml.safe_load(path.read_text())
    del document["prefill_attention_s"]
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    read = read_preset_file(path)
    assert read.prefill_attention_s == 0.0
    assert read == dataclasses.replace(model, kv_offload_gib=0.0)


@pytest.mark.parametrize(("edit", "message"), [
    (("prefill_attention_s", -1e-9), "prefill_attention_s: Input should be greater than or equal to 0"),
    (("base_s", -1.0), "base_s: Input should be greater than or equal to 0"),
    (("seq_s", "fast"), "seq_s: Input should be a valid number"),
    (("surprise", 1), "surprise: Extra inputs are not permitted"),
    (("provenance", {"kind": "guessed", "where": "x", "how": "y"}), "provenance.kind: Input should be"),
])
def test_a_wrong_key_is_named(tmp_path, edit, message):
    path = tmp_path / "p.yaml"
    write_preset_file(preset("llama3.1-8b-h100"), path)
    document = yaml.safe_load(path.read_text())
    document[edit[0]] = edit[1]
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match=message):
        read_preset_file(path)


def test_a_missing_file_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: cannot read"):
        read_preset_file(tmp_path / "nope.yaml")
