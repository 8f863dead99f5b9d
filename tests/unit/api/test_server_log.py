"""The server's log lines and its introduction (api/server.py)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from posttrain.api.server import OneLineFormatter, introduction
from posttrain.config import ServerConfig


def record_with_error(message: str) -> logging.LogRecord:
    try:
        raise ValueError("bad value\nsecond line")
    except ValueError:
        info = sys.exc_info()
    return logging.LogRecord("posttrain.x", logging.ERROR, __file__, 1, message, (), info)


def test_an_error_with_its_exception_is_one_line_below_debug():
    line = OneLineFormatter(tracebacks=False).format(record_with_error("operation %s failed"))
    assert "\n" not in line
    assert line.endswith(
        "ERROR posttrain.x: operation %s failed (ValueError: bad value second line)"
    )


def test_a_traceback_passed_as_text_keeps_its_last_line():
    text = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: boom\n'
    record = logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, text, (), None)
    line = OneLineFormatter(tracebacks=False).format(record)
    assert line.endswith("ERROR uvicorn.error: RuntimeError: boom")


def test_debug_keeps_the_traceback():
    text = OneLineFormatter(tracebacks=True).format(record_with_error("failed"))
    assert "Traceback (most recent call last)" in text
    assert text.count("\n") > 2


def test_the_introduction_names_the_models_urls_and_data_directory():
    config = ServerConfig(host="::1", data_dir=Path("runs/data"))
    assert introduction(config, 8123) == (
        "posttrain: serving posttrain/tiny-qwen3, posttrain/tiny-qwen3-moe at"
        " http://[::1]:8123 (the SDK's base_url; dashboard http://[::1]:8123/;"
        " data in ./runs/data)"
    )
