import logging

import pytest

from fa4 import log, settings


def test_log_level_from_fa4_log(monkeypatch):
    monkeypatch.delenv("FA4_LOG", raising=False)
    assert settings.log_level() is None
    monkeypatch.setenv("FA4_LOG", "DEBUG")
    assert settings.log_level() == "debug"
    monkeypatch.setenv("FA4_LOG", "loud")
    with pytest.raises(ValueError, match="FA4_LOG must be one of debug, info, warning, error"):
        settings.log_level()


def test_configure_sets_the_fa4_logger(monkeypatch):
    logger = logging.getLogger("fa4")
    before = logger.level
    try:
        monkeypatch.setenv("FA4_LOG", "info")
        log.configure()
        assert logger.level == logging.INFO and not log.debug_enabled()
        monkeypatch.setenv("FA4_LOG", "debug")
        log.configure()
        assert log.debug_enabled()
    finally:
        logger.setLevel(before)
