"""Which processes of a failed group failed first, read from how each ended and what each said.

When one process of a job dies, the others soon end too, and each in a way that looks like a failure: gloo
aborts a process whose peer vanished mid-collective (or its collective crashes on the closed connection), its
collective raises ("Gloo AllGather failed: ... Connection closed by peer"), JAX's heartbeat aborts it ("The
following tasks are unhealthy ..."), or mirrorax's failure hook makes it leave, naming the process that
failed first (:mod:`mirrorax.cluster.failure`). ``mirrorax launch`` must name, and count against a slot, only
the processes that failed first (the *causes*); a process that left because a peer vanished is a *survivor*,
however it exits: with a status, an abort, a crash, or its own words of failure.

The evidence, strongest first: a process that raised an error of its own ("mirrorax: process K of N failed
with X", X not a lost peer); a process stopped (SIGSTOP, a debugger: the heartbeat names it); a process the
others named (the failure hook's "process K of N failed (X)", the heartbeat's list of unhealthy tasks); a
process killed by a signal a survivor never dies by (SIGKILL, an outside SIGTERM). Without any of it, the
first process to exit with an error that never said it lost a peer. Pure functions: the launcher passes
what it saw.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence, Set

from mirrorax.cluster.preemption import PREEMPTED_EXIT_CODE

__all__ = ["causes", "first_failed", "own_words", "unhealthy", "describe", "peer_lost", "SURVIVOR_SIGNALS"]

_OWN = re.compile(r"mirrorax: process (\d+) of \d+ failed with (.*?)(; leaving now|$)")
_NAMED = re.compile(r"mirrorax: process (\d+) of \d+ failed \((.*)\); process \d+ stops too")
# What a process prints when it fails only because a peer it was exchanging data with went away (gloo aborts
# the survivor within milliseconds of a SIGKILLed peer, often inside the same poll of the launcher).
_PEER_LOST = re.compile(r"gloo::|[Cc]onnection (closed|reset) by peer|collective mismatch|Broken pipe")
#: The signals a survivor dies by when a peer it exchanged data with went away: gloo and XLA abort it, or its
#: collective crashes on the closed connection (a segfault, seen when a peer is SIGKILLed mid-step).
SURVIVOR_SIGNALS = frozenset({-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS})


def peer_lost(line: str) -> bool:
    """Whether ``line`` says that its process lost a peer (gloo's words, a closed connection)."""
    return _PEER_LOST.search(line) is not None


def causes(codes: Sequence[int | None], tails: Sequence[Sequence[str]], lost: Set[int], first: int,
           frozen: Set[int] = frozenset()) -> list[int]:
    """The ranks that failed first, the one to name first.

    Args:
      codes: each rank's exit status as the launcher saw it before it signalled any (``None``: running; negative:
        killed by that signal), plus any death by an outside signal seen while it stopped the others.
      tails: each rank's last lines.
      lost: the ranks whose output said at some point that they lost a peer (every line is looked at, as a stack
        dump after the line can push it out of the tail): survivors.
      first: the first failure the launcher saw (the answer when there is no other evidence).
      frozen: the ranks found stopped (``T`` in ``/proc``).

    Returns:
      The causes in order of evidence (see the module's docstring), never a survivor unless every rank that
      failed is one (then ``[first_failed(...)]``).
    """
    survivors = set(lost)
    raised: list[int] = []
    for rank, tail in enumerate(tails):
        words = own_words(tail)
        if words is None:
            continue
        if peer_lost(words):
            survivors.add(rank)  # its own words say it only lost a peer
        else:
            raised.append(rank)
    named: list[int] = []
    for tail in tails:
        for line in tail:
            m = _NAMED.search(line)
            if m and not peer_lost(m.group(2)):
                named.append(int(m.group(1)))
    named += sorted(unhealthy(tails))
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0 and c not in SURVIVOR_SIGNALS]
    found: list[int] = []
    for rank in [*raised, *sorted(frozen), *named, *killed]:
        if 0 <= rank < len(codes) and rank not in found and rank not in survivors:
            found.append(rank)
    return found or [first_failed(codes, first, survivors)]


def first_failed(codes: Sequence[int | None], first: int, lost: Set[int]) -> int:
    """Among the ranks that exited non-zero by themselves: the first killed by a signal a survivor does not die
    by; else the first whose output never said that it lost a peer, one that exited with an error before one
    that crashed; ``first`` (the first failure seen) when every one of them said so."""
    for rank, code in enumerate(codes):
        if code is not None and code < 0 and code not in SURVIVOR_SIGNALS:
            return rank
    for exited in (True, False):
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in lost and (code > 0) == exited:
                return rank
    return first


def own_words(tail: Sequence[str]) -> str | None:
    """What a process said of its own failure ("mirrorax: process K of N failed with X; leaving now ..." -> X),
    or ``None`` when it said nothing of the kind."""
    for line in tail:
        m = _OWN.search(line)
        if m:
            return m.group(2)
    return None


def unhealthy(tails: Sequence[Sequence[str]]) -> set[int]:
    """The ranks JAX's heartbeat declared dead ("The following tasks are unhealthy ...:" then the ids)."""
    found: set[int] = set()
    for tail in tails:
        lines = list(tail)
        for i, line in enumerate(lines[:-1]):
            if "tasks are unhealthy" in line:
                found.update(int(x) for x in re.findall(r"\d+", lines[i + 1]))
    return found


def describe(code: int) -> str:
    """An exit status in words: ``"exit code 3"``, ``"killed by signal SIGKILL"``.

    Example:
      >>> describe(-9)
      'killed by signal SIGKILL'
    """
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}" + (": preempted" if code == PREEMPTED_EXIT_CODE else "")
