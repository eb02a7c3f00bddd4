"""Errors a user causes, each a UserError and the built-in type code would expect (FileNotFoundError...).
runs.run.run_main prints one as `error: <message>` (naming the flag or file, the value, the fix), status 2."""


class UserError(Exception):
    """A mistake in what the user gave, with a message that names the fix."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""  # a KeyError would quote it


class ConfigError(UserError, ValueError):
    """A flag's value, or a combination of flags, that cannot work."""


class DataError(UserError, ValueError):
    """A data file, row or column that cannot be used."""


class MissingPath(UserError, FileNotFoundError):
    """A file or directory the flags name that is not there."""


class MissingColumn(UserError, KeyError):
    """A data column the flags name that the data lacks."""


class MissingDependency(UserError, ImportError):
    """An optional package the flags need (vllm, torchvision...)."""


class RewardError(UserError, RuntimeError):
    """A reward function that raises, times out or returns garbage; an unreachable reward server."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is damaged or incomplete, with no intact one to fall back to."""


class TrainingDiverged(UserError, FloatingPointError):
    """Non-finite or exploding gradients, a collapsed policy: stopped before the bad update is saved."""


class Stopped(UserError):
    """The run stopped on SIGINT / SIGTERM at a step boundary (its checkpoint, if any, complete)."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


class OutOfMemory(UserError, MemoryError):
    """The trainer and the engine do not fit on the GPU together: found before the crash, naming the fix."""


class MissingName(UserError, AttributeError):
    """A function the flags name (--reward_fn file.py:name) that its file does not define."""
