"""The simworker's engine model from its config: the demo's prefill scaling."""

from __future__ import annotations

import pytest

from simworker.worker import SimWorker, SimWorkerConfig
from sim.step_time import preset


def test_prefill_scale_multiplies_only_the_prompt_cost_of_the_preset() -> None:
    base = preset("llama3.1-8b-h100")
    worker = SimWorker(SimWorkerConfig(kv_events=None, prefill_scale=10.0, num_blocks=64))
    try:
        model = worker.engine.model
        assert model.prefill_token_s == pytest.approx(10.0 * base.prefill_token_s)
        assert (model.base_s, model.context_token_s, model.seq_s) == (
            base.base_s, base.context_token_s, base.seq_s)
    finally:
        worker.close()


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_a_non_positive_prefill_scale_is_refused(scale: float) -> None:
    with pytest.raises(ValueError, match="prefill_scale"):
        SimWorkerConfig(prefill_scale=scale)
