"""Fitting the engine model's step time to measured steps (``sluice calibrate``, bench/gpu_profile.py).

The model (sim/step_time.py) is linear in five non-negative coefficients::

    step_s = base_s + prefill_token_s·P + seq_s·S + context_token_s·C + prefill_attention_s·P·(C − P/2)

for a step that computes ``P`` prompt tokens, runs ``S`` sequences and attends over ``C``
context tokens. A measurement is one such step (or the mean of several alike) with its
duration; a prefill step computes one prompt's ``P`` tokens behind ``C − P`` cached ones, so
its attention pairs (each new token over the context before it) are ``P·(C − P/2)``, and a
decode step (``P = 0``) has none. The fit minimises the *relative* squared error (each sample
weighted by ``1/seconds``), so a 2 ms decode step counts as much as a 400 ms prefill, under
the constraint that no coefficient is negative (a negative term has no physical reading and
extrapolates badly). With five coefficients the constrained problem is solved exactly by
trying every set of free coefficients (32 least-squares solves) and keeping the best
feasible one.

Quality is reported as R² (on seconds, unweighted: the share of the variance explained) and
the largest relative error of any sample; :func:`r_squared_without_prefill_attention` says
how much the attention term adds on the same samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

COEFFICIENTS = ("base_s", "prefill_token_s", "seq_s", "context_token_s", "prefill_attention_s")


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step: its shape and how long it took."""

    prefill_tokens: int
    seqs: int
    context_tokens: int
    seconds: float
    kind: str = ""  # what the sample measured (e.g. "cold prefill", "decode"), for reports

    @property
    def prefill_pairs(self) -> float:
        """The prefill's attention pairs: its ``P`` new tokens over the ``C − P`` before them."""
        return self.prefill_tokens * (self.context_tokens - self.prefill_tokens / 2)

    def features(self) -> tuple[float, float, float, float, float]:
        """What each coefficient multiplies, in :data:`COEFFICIENTS`' order."""
        return (1.0, float(self.prefill_tokens), float(self.seqs), float(self.context_tokens),
                self.prefill_pairs)


@dataclass(frozen=True, slots=True)
class StepTimeFit:
    """The fitted coefficients and how well they explain the samples."""

    base_s: float
    prefill_token_s: float
    seq_s: float
    context_token_s: float
    prefill_attention_s: float
    r_squared: float
    max_relative_error: float
    samples: int

    def coefficients(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in COEFFICIENTS}

    def predict(self, sample: StepSample) -> float:
        return (self.base_s + self.prefill_token_s * sample.prefill_tokens + self.seq_s * sample.seqs
                + self.context_token_s * sample.context_tokens
                + self.prefill_attention_s * sample.prefill_pairs)

    def relative_errors(self, samples: Sequence[StepSample]) -> list[float]:
        """(predicted − measured) / measured, per sample."""
        return [(self.predict(s) - s.seconds) / s.seconds for s in samples]


class FitError(ValueError):
    """The samples cannot determine the model (too few, or not positive)."""


def nonnegative_relative_fit(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """The non-negative coefficients ``c`` minimising the relative squared error of
    ``features @ c ≈ seconds``: the best feasible least-squares solve over every set of free
    columns (exact, and cheap for the few columns a step model has)."""
    weighted_x, weighted_y = features / seconds[:, None], np.ones_like(seconds)
    columns = features.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(columns, 0, -1):
        for free in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(weighted_x[:, free], weighted_y, rcond=None)
            if (solution < 0).any():
                continue
            coefficients = np.zeros(columns)
            coefficients[list(free)] = solution
            residual = float(np.sum((weighted_x @ coefficients - weighted_y) ** 2))
            if best is None or residual < best[0]:
                best = (residual, coefficients)
    if best is None:  # pragma: no cover - a single free positive column always fits
        raise FitError("no non-negative fit exists")
    return best[1]


def r_squared(seconds: np.ndarray, predicted: np.ndarray) -> float:
    """The share of the measured times' variance the prediction explains."""
    spread = float(np.sum((seconds - seconds.mean()) ** 2))
    return 1.0 - float(np.sum((seconds - predicted) ** 2)) / spread if spread > 0 else 1.0


def fit_step_time(samples: Sequence[StepSample]) -> StepTimeFit:
    """The non-negative coefficients that best explain ``samples`` in relative terms."""
    if len(samples) < len(COEFFICIENTS):
        raise FitError(f"{len(samples)} samples cannot fit {len(COEFFICIENTS)} coefficients")
    bad = [s for s in samples if not s.seconds > 0 or min(s.prefill_tokens, s.seqs, s.context_tokens) < 0
           or s.context_tokens < s.prefill_tokens]
    if bad:
        raise FitError("a sample needs a positive duration, non-negative counts and a context that "
                       f"holds its prompt tokens: {bad[0]}")
    features = np.array([s.features() for s in samples])
    seconds = np.array([s.seconds for s in samples])
    coefficients = nonnegative_relative_fit(features, seconds)
    predicted = features @ coefficients
    return StepTimeFit(*(float(c) for c in coefficients), r_squared=r_squared(seconds, predicted),
                       max_relative_error=float(np.max(np.abs(predicted - seconds) / seconds)),
                       samples=len(samples))


def r_squared_without_prefill_attention(steps: Sequence[StepSample]) -> float:
    """R² of the same fit with ``prefill_attention_s`` held at 0: what the attention term adds
    to explaining ``steps`` (much, where prefills spend a share of their time on attention)."""
    features = np.array([s.features()[:-1] for s in steps])
    seconds = np.array([s.seconds for s in steps])
    coefficients = nonnegative_relative_fit(features, seconds)
    return r_squared(seconds, features @ coefficients)
