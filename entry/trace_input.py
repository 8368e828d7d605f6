"""The trace a simulator command reads (``sluice replay`` and ``sluice tune`` with
``--format F --trace T``): loaded, and checked for calls no worker could ever fit."""

from __future__ import annotations

from pathlib import Path

from entry.usage_error import usage_error
from sim.runs import replay_programs
from sim.step_time import StepTimeModel
from sim.traces import TraceError

# an error names this many calls that cannot fit, then counts the rest
_OFFENDERS_SHOWN = 20


def load_trace(fmt: str, trace: Path, time_scale: float, model: StepTimeModel, **loader_options):
    """The trace's programs and block size; a trace that cannot be read, holds nothing or
    holds a call no worker could fit is a usage error naming the problem."""
    try:
        programs, block_size = replay_programs(fmt, trace, time_scale, **loader_options)
    except TraceError as err:
        raise usage_error(str(err)) from None
    except (ValueError, OSError) as err:
        raise usage_error(f"{trace}: {err}") from None
    if not programs:
        raise usage_error(f"{trace}: the trace holds no requests")
    _check_fits(programs, model, block_size, trace)
    return programs, block_size


def _check_fits(programs, model: StepTimeModel, block_size: int, trace: Path) -> None:
    """A call whose prompt and output exceed a worker's whole KV pool can never run: name
    every such call (the first :data:`_OFFENDERS_SHOWN`, then how many more). The presets
    have no context length of their own; the pool is the limit."""
    capacity = model.kv_capacity_tokens // block_size * block_size
    offenders = [(spec.session_id, k, need) for spec in programs for k, call in enumerate(spec.calls)
                 if (need := call.prompt_tokens + call.output_tokens) > capacity]
    if not offenders:
        return
    sessions = len({session for session, _, _ in offenders})
    lines = [f"  session {session} call {k}: {need:,} tokens"
             for session, k, need in offenders[:_OFFENDERS_SHOWN]]
    if len(offenders) > _OFFENDERS_SHOWN:
        lines.append(f"  and {len(offenders) - _OFFENDERS_SHOWN:,} more")
    verb = "needs" if len(offenders) == 1 else "need"
    raise usage_error(f"{trace}: {_count(len(offenders), 'call')} in {_count(sessions, 'session')} "
                f"{verb} more KV than a worker's whole pool ({capacity:,} tokens under preset "
                f"{model.name!r}):\n" + "\n".join(lines))


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"
