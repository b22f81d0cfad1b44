"""What ``matformer-server`` says of the run's progress on its console: one line per closed
round, and a summary once the run is finished. Both read the records the status API reads
(the round record of ``server/history.py``, the status snapshot), so the two never disagree.

    round 7 closed (8 of 8 rounds done): 1,024 tokens from client-0, client-1 in 0.42 s; ...
    the run is finished: 8 rounds, 7,574 tokens in 25 s; members client-0, client-1; ...
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matformer.server.rounds import OpenRound

if TYPE_CHECKING:
    from matformer.server.sections import RoundSection
    from matformer.server.state import RunState

NAMES_SHOWN = 6  # members named in a line; more are counted


def round_line(state: RunState, stop: RoundSection, rnd: OpenRound) -> str:
    """(lock held) The round just recorded in ``state``, in one line: how far the run is
    against ``stop`` ([round]), who delivered how many tokens in how long, each tier's
    training loss, who was dropped."""
    record = state.rounds[-1]
    losses = {int(tier): points[-1][1] for tier, points in state.loss.items()
              if points and points[-1][0] == rnd.index}
    contributors = [rnd.names.get(client, client) for client in rnd.submissions]
    line = (f"round {rnd.index} closed{_progress(state, stop, record)}: "
            f"{record['tokens']:,} tokens from {_names(contributors)} in "
            f"{record['duration_s']:.2f} s{_losses(losses)}")
    if record["dropped"]:
        line += f"; dropped {_names(d['name'] for d in record['dropped'])}"
    return line


def summary_line(status: Mapping[str, Any], checkpoint: Path) -> str:
    """The finished run from its status snapshot (``Coordinator.snapshot`` with its round
    records): rounds, tokens, the members it saw, the wall time from the first round's
    opening to the last one's close, each tier's last training loss, and where the final
    checkpoint is."""
    names = {m["name"] for m in status["members"]} | {d["name"] for d in status["departed"]}
    names |= {e["name"] for e in status["excluded"] if e["name"]}
    rounds = status["rounds"]
    wall = f" in {rounds[-1]['closed_at'] - rounds[0]['opened_at']:,.0f} s" if rounds else ""
    losses = {int(tier): point[1] for tier, point in status["last_loss"].items()}
    return (f"the run is finished: {status['round']:,} rounds, {status['tokens']:,} tokens"
            f"{wall}; members {_names(sorted(names))}"
            f"{_losses(losses, 'last training loss')}; final checkpoint {checkpoint}")


def _progress(state: RunState, stop: RoundSection, record: Mapping[str, Any]) -> str:
    """" (8 of 8 rounds done)" against [round] rounds, " (7,574 of 10,000 tokens done)"
    against tokens; "" else. Rounds are numbered from 0, so round 7 is the 8th."""
    if stop.rounds is not None:
        return f" ({record['round'] + 1} of {stop.rounds} rounds done)"
    if stop.tokens is not None:
        done = state.tokens + record["tokens"]  # state.tokens counts up to the round before
        return f" ({done:,} of {stop.tokens:,} tokens done)"
    return ""


def _losses(losses: Mapping[int, float], what: str = "loss") -> str:
    """"; loss tier 0 4.935, tier 1 4.849"; "" without losses."""
    if not losses:
        return ""
    return f"; {what} " + ", ".join(f"tier {t} {v:.3f}" for t, v in sorted(losses.items()))


def _names(names: Iterable[str]) -> str:
    """Up to NAMES_SHOWN names, then how many more."""
    names = list(names)
    more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
    return ", ".join(names[:NAMES_SHOWN]) + more or "nobody"

