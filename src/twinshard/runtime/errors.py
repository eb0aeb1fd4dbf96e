"""Errors shared by every rank-aware part of twinshard."""

from __future__ import annotations


class WorldError(RuntimeError):
    """A distributed entry point was used without (or with the wrong) process world."""


class RankFailure(RuntimeError):
    """One or more ranks failed; raised on every rank (or in the launching process).

    ``failures`` maps each failing rank to the formatted traceback it reported,
    the originating failure first (its rank is ``rank``); ``stuck`` lists ranks
    that were still blocked (and were stopped) when the failure was detected.
    """

    def __init__(
        self,
        failures: dict[int, str],
        stuck: tuple[int, ...] = (),
        step: str | None = None,
        finished: tuple[int, ...] = (),
    ):
        self.failures = dict(failures)
        self.stuck = tuple(sorted(stuck))
        self.finished = tuple(sorted(finished))
        self.step = step
        first = self.rank = next(iter(self.failures))
        where = f" in step {step!r}" if step else ""
        lines = [
            f"rank {first} failed{where}"
            + (
                f" (then also ranks {[r for r in self.failures if r != first]})"
                if len(self.failures) > 1
                else ""
            )
        ]
        if self.stuck:
            lines.append(f"ranks {list(self.stuck)} were stuck (in a collective or busy) and were stopped")
        if self.finished:
            lines.append(
                f"ranks {list(self.finished)} finished normally: a rank that skips a collective "
                "its peers enter leaves them waiting until the timeout"
            )
        lines.append(f"--- traceback of rank {first} ---")
        lines.append(self.failures[first].rstrip())
        super().__init__("\n".join(lines))

    def message(self) -> str:
        """The origin's exception as it printed it, without the traceback frames: its
        ``Type: message`` lines (all of them: a message may span several lines), or, for a note
        that is no traceback, the note itself."""
        return exception_text(self.failures[self.rank])

    def __reduce__(self):  # picklable across processes
        return (RankFailure, (self.failures, self.stuck, self.step, self.finished))


def exception_text(text: str) -> str:
    """The exception part of a formatted traceback: the lines after its last frame (a frame is a
    ``  File ...`` line and its indented source lines), so a message of several lines stays
    whole; a text without frames is returned stripped."""
    lines = text.rstrip().splitlines()
    frames = [i for i, ln in enumerate(lines) if ln.startswith("  File ")]
    if not frames:
        return "\n".join(ln for ln in lines if ln.strip())
    i = frames[-1] + 1
    while i < len(lines) and lines[i].startswith("    "):  # its source line and ^^^ markers
        i += 1
    return "\n".join(ln for ln in lines[i:] if ln.strip())


def short_reason(exc: BaseException) -> str:
    """``Type: reason`` of ``exc`` in one line, for a message that wraps a library's error: the
    first line of its text, or for torch.load's weights-only refusal (15 lines of advice) the line
    that says what it met."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    reason = lines[0] if lines else ""
    for i, ln in enumerate(lines[:-1]):
        if ln.endswith("WeightsUnpickler error:"):
            reason = lines[i + 1]
    return f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__
