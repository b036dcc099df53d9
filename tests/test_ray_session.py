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
    for name in ray_session.FORWARDED_ENV + ("RAY_JOB_CONFIG_JSON_ENV_VAR",):
        monkeypatch.delenv(name, raising=False)
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


def test_the_drivers_quieting_variables_travel_to_every_worker(calls, monkeypatch):
    """A worker on a node started by `ray start` has that node's environment: the variables the
    driver's quiet_libraries set go in the job's runtime_env, beside the caller's own, and not those
    a `ray job submit --runtime-env` names already (Ray refuses a variable named twice)."""
    import json

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    ray_session.connect("10.0.0.1:6379", runtime_env={"env_vars": {"A": "b"}, "pip": ["x"]})
    assert calls[0]["runtime_env"] == {"pip": ["x"], "env_vars": {"TQDM_DISABLE": "1",
                                                                 "HF_HUB_DISABLE_PROGRESS_BARS": "1", "A": "b"}}
    calls.clear()
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR",
                       json.dumps({"runtime_env": {"env_vars": {"TQDM_DISABLE": "1"}}}))
    ray_session.connect()
    assert calls[0]["runtime_env"] == {"env_vars": {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}}
