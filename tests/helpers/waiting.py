"""Waiting in tests for a state another thread or process is to reach: polls with a deadline that
only bounds a test whose state never comes (never a fixed sleep)."""

from __future__ import annotations

import time


def settle(predicate, timeout: float = 30.0, interval: float = 0.005):
    """Poll ``predicate`` until it returns something truthy or ``timeout`` passes; returns its last
    value. For a state another thread or process is to reach (never a fixed sleep): the caller
    asserts on it with its own message. The deadline only bounds a test whose state never comes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy (returned) or fail after ``timeout``."""
    value = settle(predicate, timeout, interval)
    if not value:
        raise AssertionError(f"condition not met within {timeout} s")
    return value
