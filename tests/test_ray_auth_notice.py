"""Ray's "token authentication is enabled" notice is dropped where stapoctl starts Ray; the rest
of Ray's auth messages, and authentication itself, are untouched (no engines)."""

from __future__ import annotations

import logging

from stapoctl.launch.ray_runtime import _quiet_token_auth_notice


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_only_the_enabled_notice_is_dropped():
    from ray._private.authentication import authentication_token_setup as auth

    _quiet_token_auth_notice()
    _quiet_token_auth_notice()  # idempotent: one filter
    assert sum(type(f).__name__ == "_DropTokenAuthNotice" for f in auth.logger.filters) == 1
    keep, level = _Keep(), auth.logger.level
    auth.logger.addHandler(keep)
    auth.logger.setLevel(logging.WARNING)
    try:
        auth._warn_token_auth_enabled()
        auth._warn_token_auth_disabled()
    finally:
        auth.logger.removeHandler(keep)
        auth.logger.setLevel(level)
    messages = keep.messages
    assert not any("is enabled" in m for m in messages)
    assert any("Token authentication is disabled" in m for m in messages)
