"""ray_session.connect: which address and init arguments each kind of caller ends up with (ray.init
is replaced by a recorder, so nothing is started)."""

import pytest

ray = pytest.importorskip("ray")

from trsp_ray.distributed import ray_session  # noqa: E402


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(seen))
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: seen.append("shutdown"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return seen


def test_defaults_and_no_op_when_initialised(calls):
    assert ray_session.connect() is True
    assert ray_session.connect("10.0.0.1:6379") is False  # already initialised: nothing joined
    assert calls == [{"address": None, "include_dashboard": False, "log_to_driver": True}]


def test_address_then_env(calls, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    ray_session.connect(local_cpus=3)  # a named cluster wins over a fresh local instance
    assert calls == [{"address": "10.0.0.2:6379", "include_dashboard": False, "log_to_driver": True}]
    calls.clear()
    ray_session.connect("10.0.0.1:6379", include_dashboard=None)
    assert calls[0]["address"] == "10.0.0.1:6379" and calls[0]["include_dashboard"] is None


def test_local_cpus_starts_a_fresh_instance(calls):
    ray_session.connect(local_cpus=3)
    assert calls == [{"address": "local", "include_dashboard": False, "log_to_driver": True, "num_cpus": 3}]


def test_session_shuts_down_only_what_it_started(calls):
    with ray_session.session() as started:
        assert started is True
    assert calls[-1] == "shutdown"
    calls[:] = [{"already": "up"}]
    with ray_session.session() as started:
        assert started is False
    assert calls == [{"already": "up"}]
