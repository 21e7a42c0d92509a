"""SampleLog: every reader of a worker's samples gets each sample once."""

from __future__ import annotations

from services.sample_log import SampleLog


def test_each_reader_gets_every_sample_once():
    log = SampleLog()
    log.extend([1, 2])
    assert log.take("router-a") == (1, 2)
    log.extend([3])
    assert log.take("router-b") == (3,)  # a new reader: what is kept (1, 2: read by every reader there was)
    assert log.take("router-a") == (3,)
    assert log.take("router-a") == () and log.take("router-b") == ()
    log.extend([4, 5])
    assert (log.take("router-b"), log.take("router-a")) == ((4, 5), (4, 5))
    assert log._samples == []  # read by every reader: nothing kept


def test_memory_is_bounded_and_silent_readers_are_forgotten(monkeypatch):
    log = SampleLog(max_samples=3, reader_ttl=60.0)
    log.take("a")
    log.extend(range(5))
    assert log.take("a") == (2, 3, 4)  # the oldest went, unread
    now = [1000.0]
    monkeypatch.setattr("services.sample_log.time.monotonic", lambda: now[0])
    log.take("gone")
    log.extend([5, 6])
    now[0] += 61  # "gone" has not read for longer than the ttl: it no longer holds samples back
    assert log.take("a") == (5, 6)
    assert log._samples == [] and "gone" not in log._cursors
