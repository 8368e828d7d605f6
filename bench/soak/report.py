"""The soak's report: the summary (figures and acceptance checks) as ``summary.json`` and
``summary.md``, and the RSS samples as ``rss.csv``."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.soak.calls import CallLedger, SoakAgentClient
from bench.soak.config import SoakSetup

# Acceptance: the gateway's RSS may grow at most this much after the baseline sample.
RSS_GROWTH_LIMIT_PCT = 10.0


def rss_figures(rss: list[tuple[float, int]], baseline_s: float) -> dict[str, Any]:
    after = [(t, v) for t, v in rss if t >= baseline_s]
    if not after:
        return {"samples": len(rss), "baseline_at_s": baseline_s, "note": "no sample after the baseline"}
    base_t, base = after[0]
    end_t, end = rss[-1]
    return {
        "samples": len(rss),
        "first_mib": round(rss[0][1] / 2**20, 1),
        "baseline_at_s": base_t,
        "baseline_mib": round(base / 2**20, 1),
        "end_at_s": end_t,
        "end_mib": round(end / 2**20, 1),
        "peak_mib": round(max(v for _, v in rss) / 2**20, 1),
        "growth_pct": round((end - base) / base * 100.0, 2),
    }


def errors_by_fault(ledger: CallLedger, faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls that did not succeed, grouped by the window from the start of one fault to
    the start of the next (before the first: ``steady``)."""
    windows = [("steady", 0.0)] + [(f"{i + 1}:{f['kind']}", f["at_s"]) for i, f in enumerate(faults)]
    grouped: dict[str, Counter[str]] = {name: Counter() for name, _ in windows}
    for at, outcome in ledger.failures:
        name = [n for n, start in windows if start <= at][-1]
        grouped[name][outcome] += 1
    return [{"window": name, "from_s": start, "failures": dict(grouped[name])} for name, start in windows]


def build_summary(setup: SoakSetup, ledger: CallLedger, client: SoakAgentClient,
                  faults: list[dict[str, Any]], rss: list[tuple[float, int]],
                  before_drain: dict[str, Any], drain: dict[str, Any], sessions_ended_s: float,
                  workdir: Path) -> dict[str, Any]:
    result = client.result.summary()
    lost = sum(ledger.lost.values())
    unclear = sum(ledger.unclear.values())
    rss_info = rss_figures(rss, setup.effective_rss_baseline_s)
    bad_input_unexpected = {f"{i + 1}:{name}": wrong for i, f in enumerate(faults)
                            if f["kind"] == "bad_input" for name, wrong in f["unexpected"].items()}
    checks = {
        "no_call_lost": lost == 0,
        "every_error_clear": unclear == 0,
        "nothing_held_or_in_flight_before_drain": bool(before_drain["settled"]),
        "gateway_drained_cleanly": drain["exit_status"] == 0 and drain["log_tracebacks"] == 0,
        "bad_input_refused_clearly": not bad_input_unexpected,
        "every_fault_recovered": all(
            f.get("gateway_saw_healthy_after_s") is not None for f in faults
            if f["kind"] in ("worker_kill", "worker_hang", "worker_restart"))
        and all(f.get("reloads_applied", 0) >= 1 for f in faults if f["kind"] == "gateway_reload"),
        "rss_growth_within_limit": rss_info.get("growth_pct", 0.0) <= RSS_GROWTH_LIMIT_PCT,
    }
    return {
        "setup": {**asdict(setup), "faults": list(setup.faults),
                  "rss_baseline_effective_s": setup.effective_rss_baseline_s},
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "calls": {
            "sent": ledger.sent,
            "succeeded": ledger.succeeded,
            "errors": sum(ledger.errors.values()),
            "errors_by_status_and_type": dict(ledger.errors.most_common()),
            "unclear": unclear,
            "unclear_by_kind": dict(ledger.unclear),
            "lost": lost,
            "lost_by_reason": dict(ledger.lost),
            "samples": ledger.samples,
        },
        "agents": {k: result[k] for k in ("programs_completed", "agents_by_api", "calls_by_api",
                                          "p50_call_s", "p99_call_s", "hit_rate", "steps_per_min")},
        "failures_by_fault_window": errors_by_fault(ledger, faults),
        "faults": faults,
        "rss": rss_info,
        "sessions_ended_s": sessions_ended_s,
        "before_drain": before_drain,
        "drain": drain,
        "acceptance": {**checks, "bad_input_unexpected": bad_input_unexpected,
                       "passed": all(checks.values())},
    }


def summary_markdown(summary: dict[str, Any]) -> str:
    setup, calls, rss, drain = summary["setup"], summary["calls"], summary["rss"], summary["drain"]
    before, acceptance = summary["before_drain"], summary["acceptance"]
    lines = [
        f"# Soak: {setup['sessions']} sessions on {setup['workers']} simworkers for "
        f"{setup['duration_s']:.0f} s, a fault every {setup['fault_every_s']:.0f} s",
        "",
        f"Acceptance: **{'passed' if acceptance['passed'] else 'FAILED'}** "
        f"(host: {summary['host']['cpus']} CPUs, Python {summary['host']['python']})",
        "",
        "| check | result |",
        "|---|---|",
        *[f"| {name.replace('_', ' ')} | {'yes' if ok else '**no**'} |" for name, ok in acceptance.items()
          if isinstance(ok, bool) and name != "passed"],
        "",
        "## Calls",
        "",
        f"- sent {calls['sent']:,}, succeeded {calls['succeeded']:,}, clear errors {calls['errors']:,}, "
        f"unclear {calls['unclear']}, **lost {calls['lost']}**",
        f"- call latency p50 {summary['agents']['p50_call_s']} s, p99 {summary['agents']['p99_call_s']} s; "
        f"programs completed {summary['agents']['programs_completed']:,}",
    ]
    for kind, n in calls["errors_by_status_and_type"].items():
        lines.append(f"- error `{kind}`: {n}")
    for kind, n in {**calls["unclear_by_kind"], **calls["lost_by_reason"]}.items():
        lines.append(f"- **{kind}**: {n}")
    lines += ["", "## Faults", "", "| # | at (s) | kind | worker | detail |", "|---|---|---|---|---|"]
    for i, fault in enumerate(summary["faults"]):
        detail = {k: v for k, v in fault.items() if k not in ("kind", "at_s", "worker", "outcomes")}
        if fault["kind"] == "bad_input":
            detail["outcomes"] = fault["outcomes"]
        lines.append(f"| {i + 1} | {fault['at_s']:.0f} | {fault['kind']} | {fault.get('worker', '')} | "
                     f"`{json.dumps(detail)}` |")
    lines += ["", "Calls that did not succeed, by the fault window they fell in:", ""]
    for window in summary["failures_by_fault_window"]:
        lines.append(f"- {window['window']} (from {window['from_s']:.0f} s): {window['failures'] or 'none'}")
    lines += [
        "", "## Gateway memory", "",
        f"- RSS at start {rss.get('first_mib')} MiB, at {rss.get('baseline_at_s')} s {rss.get('baseline_mib')} MiB "
        f"(baseline), at the end {rss.get('end_mib')} MiB, peak {rss.get('peak_mib')} MiB: growth "
        f"**{rss.get('growth_pct')} %** after the baseline (limit {RSS_GROWTH_LIMIT_PCT:.0f} %)",
        "", "## Drain", "",
        f"- before the drain: {before['calls_held']:.0f} held, {before['calls_in_flight']} in flight, "
        f"{before['calls_waiting']} waiting, worker calls in flight {before['worker_calls_in_flight']}; "
        f"{before['programs_tracked']} programs still tracked {before['programs_by_state']}",
        f"- SIGTERM to exit: {drain['drain_s']} s, exit status {drain['exit_status']}, "
        f"tracebacks in the log {drain['log_tracebacks']}, log lines by level {drain['log_lines_by_level']}",
    ]
    if drain["log_error_events"]:
        lines.append(f"- error events logged: {drain['log_error_events']}")
    return "\n".join(lines) + "\n"


def write_results(out: Path, summary: dict[str, Any], rss: list[tuple[float, int]]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(summary))
    (out / "rss.csv").write_text("t_s,rss_bytes\n" + "".join(f"{t},{v}\n" for t, v in rss))
