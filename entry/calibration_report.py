"""What ``sluice calibrate`` shows of a fit (entry/calibration_driver.py measures and fits): the
coefficients, the fit's quality overall and per worker, the round trip, the worst samples, and a
residual plot."""

from __future__ import annotations

import numpy as np

from entry.calibration_driver import Calibration
from sim.calibration import COEFFICIENTS, r_squared, r_squared_without_prefill_attention


def report(calibration: Calibration, worst: int = 5) -> str:
    """The fit as text: coefficients, quality, the round trip, the worst samples."""
    fit = calibration.fit
    units = {"base_s": ("ms", 1e3), "prefill_token_s": ("µs/token", 1e6), "seq_s": ("µs/seq", 1e6),
             "context_token_s": ("ns/token", 1e9), "prefill_attention_s": ("ns/token pair", 1e9)}
    workers = calibration.workers or (calibration.info,)
    where = ", ".join(info.url for info in workers)
    together = f" ({len(workers)} workers measured at once)" if len(workers) > 1 else ""
    lines = [f"step-time fit to {fit.samples} steps of {calibration.info.model} at {where}{together}:"]
    for name in COEFFICIENTS:
        unit, scale = units[name]
        lines.append(f"  {name:<19} {getattr(fit, name):.6g}  ({getattr(fit, name) * scale:.4g} {unit})")
    lines.append(f"  R² {fit.r_squared:.4f}, max relative error {fit.max_relative_error:.1%}")
    lines.append(f"  request round trip {calibration.round_trip_s * 1e3:.3f} ms (removed from the TTFTs)")
    lines.append(f"  without prefill attention (prefill_attention_s held at 0): R² "
                 f"{r_squared_without_prefill_attention(calibration.samples):.4f}")
    if len(workers) > 1:
        for info, samples in calibration.worker_samples():
            seconds = np.array([sample.seconds for sample in samples])
            predicted = np.array([fit.predict(sample) for sample in samples])
            lines.append(f"  {info.url}: {len(samples)} steps, R² {r_squared(seconds, predicted):.4f}, "
                         f"max relative error {float(np.max(np.abs(predicted - seconds) / seconds)):.1%}")
    errors = fit.relative_errors(calibration.samples)
    order = sorted(range(len(errors)), key=lambda i: -abs(errors[i]))[:worst]
    lines.append("  worst samples (kind, P, S, C: measured → predicted):")
    for i in order:
        s = calibration.samples[i]
        lines.append(f"    {s.kind:<15} P={s.prefill_tokens:<6} S={s.seqs:<3} C={s.context_tokens:<7} "
                     f"{s.seconds * 1e3:9.3f} ms → {fit.predict(s) * 1e3:9.3f} ms ({errors[i]:+.1%})")
    return "\n".join(lines)


def plot_residuals(calibration: Calibration, path) -> None:
    """Relative error of each sample against its measured time, one colour per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit = calibration.fit
    errors = fit.relative_errors(calibration.samples)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for kind in sorted({s.kind for s in calibration.samples}):
        points = [(s.seconds * 1e3, e * 100) for s, e in zip(calibration.samples, errors) if s.kind == kind]
        axes.scatter(*zip(*points), label=kind, s=18)
    axes.axhline(0, color="grey", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_xlabel("measured step (ms)")
    axes.set_ylabel("(predicted − measured) / measured (%)")
    axes.set_title(f"{calibration.info.model}: R² {fit.r_squared:.4f}, "
                   f"max |error| {fit.max_relative_error:.1%}")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
