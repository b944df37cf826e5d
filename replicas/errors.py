"""Errors the engine raises that callers across a process boundary tell apart (no torch here:
the ingress imports this)."""
from __future__ import annotations


class StepFailed(RuntimeError):
    """An engine step raised: the requests it had scheduled were aborted (their blocks freed) and
    end with this error; every other request is untouched and the engine can step again."""

    def __init__(self, request_ids: list[str], message: str):
        super().__init__(f"the engine step failed: {message}")
        self.request_ids = request_ids
        self.reason = message

    def __reduce__(self):  # crosses process boundaries intact
        return (StepFailed, (self.request_ids, self.reason))
