"""User-facing errors: the CLI prints their message as one line, never a traceback."""


class UserError(ValueError):
    """Bad input: the message names the field and the fix."""


class RunFailed(RuntimeError):
    """A run that cannot go on (an engine died, a checkpoint could not be written): the CLI
    prints the message as one line (it says how to resume) and exits 1."""


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
