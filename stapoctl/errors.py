"""User-facing errors: the CLI prints their message as one line, never a traceback."""

from typing import Callable, Iterable, Iterator, Optional


class UserError(ValueError):
    """Bad input: the message names the field and the fix."""


class RunFailed(RuntimeError):
    """A run that cannot go on (an engine died, a checkpoint could not be written): the CLI
    prints the message as one line (it says how to resume) and exits 1."""


class EngineFault(RunFailed):
    """An engine actor died or stopped answering where the run cannot carry on without it (a weight
    push over a transport that cannot re-link a new process, a wait past its bound). The message
    names the actor, its node and what it was doing; inside a run the trainer adds how to resume."""


class RunStopped(RuntimeError):
    """A run stopped on request (a signal), checkpointed unless aborted: exit 128 + signum."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class AlarmStopped(RunStopped):
    """A run-health alarm stopped the run (`trainer.alarm_action=stop`): checkpointed, KILLED with
    the alarm named; exit 3, told apart from a signal's 128 + signum."""

    def __init__(self, message: str, alarms: tuple[str, ...] = ()):
        super().__init__(message, 0)
        self.alarms = tuple(alarms)

    @property
    def exit_code(self) -> int:
        return 3


def exception_chain(exc: BaseException,
                    links: Callable[[BaseException], Iterable[Optional[BaseException]]]) -> Iterator[BaseException]:
    """`exc` and every exception reachable from it through `links(e)` (e.g. `__cause__`), each
    once: the walk the disk-full check and the actor-error reader share, each with its own links."""
    seen: set[int] = set()
    todo: list[Optional[BaseException]] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += list(links(e))


def labelled(label: str, message: object, style: str = "bold red"):
    """`label` in `style`, then `message` as plain text (a `rich.text.Text`): an exception's, an
    engine's or a user's text may hold `[/…]` (gloo's `[/…/pair.cc:553]`, an override value), which
    rich's markup would read as a closing tag and raise `MarkupError` instead of printing it."""
    from rich.text import Text

    return Text.assemble((label, style), " ", str(message))
