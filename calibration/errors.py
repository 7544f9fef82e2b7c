"""The error the quantize stage raises for problems a user can fix (data, budget, gate, model)."""


class CalibrationError(Exception):
    """Bad calibration input or a failed check; the message names the thing, the problem and the fix, in one line.

    The pipeline prints ``str(e)`` and exits with ``exit_code``; nothing is left in the output directory.
    """

    exit_code: int = 4

    def __init__(self, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.details = details  # for a command's --json error object: the attempts of a failed gate, say
