"""Errors a user causes: a flag, a path, a data row, a reward function, a damaged checkpoint, a diverging run.

Each is a UserError and also the built-in type code would expect (a missing file is a FileNotFoundError...).
The scripts' entry point (run.run_main) prints a UserError as one line, `error: <message>`, and exits with
status 2, without a traceback (RFT_DEBUG=1 shows it); any other exception is a bug of ours and
keeps its traceback. The message names the flag or file, the value, and the fix.
"""


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
    """Rewards that failed: a reward function that raises, times out or returns garbage, an unreachable
    reward server."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is damaged or incomplete, with no intact one to fall back to."""


class TrainingDiverged(UserError, FloatingPointError):
    """Non-finite gradients, an exploding gradient norm or a collapsed policy: the run stops before the bad
    update is applied or saved; the message names the intact checkpoint and the flags to change."""


class Stopped(UserError):
    """The run stopped on SIGINT / SIGTERM at a step boundary (its checkpoint, if any, complete)."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


class OutOfMemory(UserError, MemoryError):
    """The trainer and the rollout engine do not fit on the GPU together: found before the allocation that
    would crash, with the flags that make room."""


class MissingName(UserError, AttributeError):
    """A function the flags name (--reward_fn file.py:name) that its file does not define."""
