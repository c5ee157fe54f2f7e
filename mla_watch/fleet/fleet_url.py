"""The fleet store's URL and its driver's errors as messages and answers show them: never its user or password."""

from __future__ import annotations

import contextlib

__all__ = ["describe_url", "error_line"]


def describe_url(url: str) -> str:
    """``url`` as messages and answers show it: ``postgresql://host:port/db``, never its user or password."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(url)
    except Exception:  # a URL psycopg cannot parse: nothing of it is repeated
        return "the fleet store (an unreadable URL)"
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{parts.get('host') or 'localhost'}{port}/{parts.get('dbname') or ''}"


def error_line(error: BaseException, url: str) -> str:
    """The first line of a driver's ``error`` (at most 300 characters), the password of ``url`` masked in it."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    from psycopg.conninfo import conninfo_to_dict

    with contextlib.suppress(Exception):
        password = conninfo_to_dict(url).get("password")
        if password:
            text = text.replace(str(password), "***")
    return text
