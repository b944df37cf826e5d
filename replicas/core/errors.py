"""Errors the engine raises that its callers (the engine core, the offline API) tell apart."""
from __future__ import annotations


class StepFailed(RuntimeError):
    """An engine step raised: the requests it had scheduled were aborted (their blocks freed) and
    end with this error; every other request is untouched and the engine can step again."""

    def __init__(self, request_ids: list[str], message: str):
        super().__init__(f"the engine step failed: {message}")
        self.request_ids = request_ids
