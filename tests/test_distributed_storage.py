"""Any storage Ray Train supports: progress records, checkpoints and resume on s3://, proven against a
local S3 server (moto's server mode on 127.0.0.1) with jobs/prune_70b.py run as a cluster job would
be: a hub id from the Hugging Face cache, a fault and a resume, exit status 0."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trsp_ray.common.errors import TrspError

ROOT = Path(__file__).resolve().parents[1]
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def s3():
    """A local S3-compatible server with bucket 'trsp'; yields the URI query that reaches it."""
    import boto3
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in AWS}
    os.environ.update(AWS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
    client.create_bucket(Bucket="trsp")
    try:
        yield {"query": f"endpoint_override={host}:{port}&scheme=http", "client": client}
    finally:
        server.stop()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_bad_storage_is_one_line_before_anything_starts(s3):
    from trsp_ray.distributed.storage import check_storage

    assert check_storage(f"s3://trsp/runs?{s3['query']}").startswith("s3://trsp/runs")
    with pytest.raises(TrspError) as err:
        check_storage(f"s3://no-such-bucket/runs?{s3['query']}")
    assert "\n" not in str(err.value) and "bucket 'no-such-bucket' does not exist" in str(err.value)
    start = time.time()
    with pytest.raises(TrspError) as err:
        check_storage(f"s3://trsp/runs?endpoint_override=127.0.0.1:{_closed_port()}&scheme=http")
    assert "\n" not in str(err.value) and "is not reachable" in str(err.value)
    print(f"unreachable endpoint refused in {time.time() - start:.1f} s")


def test_records_are_objects_on_s3(s3):
    from trsp_ray.distributed.storage import RunRecords

    records = RunRecords(f"s3://trsp/runs?{s3['query']}", "r1")
    for i in range(3):
        records.write({"event": "round", "round": i})
    assert [r["round"] for r in records.read()] == [0, 1, 2]
    assert records.marker("fault-0") is None
    records.set_marker("fault-0", "x")
    assert records.marker("fault-0") == "x"
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket="trsp", Prefix="runs/r1/")["Contents"]]
    assert sum("/records/" in k and k.endswith(".json") for k in keys) == 3


@pytest.fixture(scope="module")
def hub_tiny(tmp_path_factory):
    """Hub id trsp-test/tiny-llama in a Hugging Face cache, made by cluster/README.md's own command."""
    home = tmp_path_factory.mktemp("hf")
    done = subprocess.run([sys.executable, "cluster/local_analogs.py", "hub", "--hf-home", str(home)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return home


@pytest.mark.ray
def test_prune_job_on_s3_resumes_after_a_fault_and_exits_0(s3, hub_tiny, tmp_path, own_ray_tmpdir):
    storage = f"s3://trsp/ray?{s3['query']}"
    local_tmp = tmp_path / "tmp"  # where the workers fetch the remote checkpoint they resume from
    local_tmp.mkdir()
    env = {**os.environ, **AWS, "HF_HOME": str(hub_tiny), "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled",
           "TMPDIR": str(local_tmp)}
    env.pop("RAY_ADDRESS", None)
    job = [sys.executable, "jobs/prune_70b.py", "--model", "trsp-test/tiny-llama", "--workers", "2", "--device", "cpu",
           "--ratio", "0.34", "--max-failures", "1", "--fault-round", "2", "--storage-path", storage,
           "--method", "trsp+heal",
           "--output", str(tmp_path / "out"), "--no-tracking",
           "--set", "stage1.first_round_steps=2", "--set", "stage1.steps_per_round=1", "--set", "stage2.steps=4",
           "--set", "distributed.checkpoint_every=2", "--set", "distributed.keep_checkpoints=1",
           "--set", "data.seqlen=32", "--set", "threads=1"]
    done = subprocess.run(job, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    print(done.stdout[-3000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["attempts"] == 2 and summary["rounds_computed"] == len(summary["drop_order"]) == 2
    assert summary["storage"].startswith("s3://trsp/ray")
    # The records and checkpoints live in the bucket; Ray Train kept only the last checkpoint.
    run = summary["storage"].rsplit("/", 1)[1]
    keys = [o["Key"] for page in s3["client"].get_paginator("list_objects_v2").paginate(Bucket="trsp", Prefix="ray/")
            for o in page.get("Contents", [])]
    checkpoints = {k.split("/")[2] for k in keys if k.count("/") > 2 and k.split("/")[2].startswith("checkpoint-")}
    print("checkpoints left in the bucket:", sorted(checkpoints))
    assert len(checkpoints) == 1 and next(iter(checkpoints)).startswith("checkpoint-stage2-step2-")
    assert any(f"ray/{run}/records/" in k for k in keys)
    from trsp_ray.distributed.storage import RunRecords

    records = RunRecords(storage, run).read()
    assert [r["round"] for r in records if r["event"] == "round"] == [1, 2]  # no round recomputed
    assert [r["resumed_from"] for r in records if r["event"] == "start"] == [None, "stage1-round1"]
    # each resumed rank fetched its files into a local folder and deleted it once read (rank 0
    # records where; no rank's folder is left)
    fetched = [r["downloaded"] for r in records if r["event"] == "start" and r["resumed_from"]]
    assert len(fetched) == 1 and all(Path(f).parent == local_tmp for f in fetched), fetched
    assert not any(Path(f).exists() for f in fetched) and not list(local_tmp.glob("trsp-restore-*"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.num_hidden_layers == 4


@pytest.mark.ray
def test_prune_job_refuses_bad_storage_on_one_line(s3, hub_tiny, tmp_path):
    env = {**os.environ, **AWS, "HF_HOME": str(hub_tiny), "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    for storage, needle in ((f"s3://nobucket/ray?{s3['query']}", "bucket 'nobucket' does not exist"),
                            (f"s3://trsp/ray?endpoint_override=127.0.0.1:{_closed_port()}&scheme=http",
                             "is not reachable")):
        done = subprocess.run([sys.executable, "jobs/prune_70b.py", "--model", "trsp-test/tiny-llama", "--workers", "2",
                               "--device", "cpu", "--storage-path", storage, "--no-tracking"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        errors = [line for line in done.stderr.splitlines() if line.startswith("prune_70b.py: error:")]
        assert done.returncode == 2 and len(errors) == 1 and needle in errors[0], done.stderr[-1500:]
        assert "Started a local Ray instance" not in done.stdout + done.stderr  # refused before Ray started


def _upload_loop(config):
    """A Ray Train worker that does `steps` steps of finished work, saving a checkpoint (async upload
    to S3) after each, under the fault spec of config["fault"]; each step's payload makes the upload
    take a while."""
    import ray.train
    import torch

    from trsp_ray.distributed import checkpoints
    from trsp_ray.distributed.events import EventLog, FaultInjector

    events = EventLog(config["records"], 0)
    meta, _ = checkpoints.restore_point(0)
    state = meta["stage1"] if meta else {"work": []}
    events.write("start", resumed_from=None if meta is None else meta["label"], work=state["work"],
                 payload=None if meta is None else [state["payload"].numel(), state["payload"].unique().tolist()])
    fault = FaultInjector([config["fault"]], 0, config["records"])
    for step in range((meta or {}).get("step", 0) + 1, config["steps"] + 1):
        state = {"work": [*state["work"], step], "payload": torch.full((config["payload"],), float(step))}
        events.write("step", step=step)
        upload = checkpoints.save({"label": f"step{step}", "stage": 2, "step": step}, state, rank=0, upload="async")
        events.write("saved", step=step, upload=upload)  # what the workers' checkpoint record says
        fault.check_stage2(step)
    checkpoints.flush_uploads()
    events.write("done", work=state["work"])
    ray.train.report({"done": 1})


@pytest.mark.ray
def test_a_worker_killed_while_its_checkpoint_uploads_resumes_from_the_last_committed_one(s3, private_ray):
    """Step 2's save is still uploading to S3 when its worker is SIGKILLed (the fault's upload=in_flight;
    the default flushes first, so no test saw this): the resumed worker starts from step 1's checkpoint,
    which every save waits to be committed before the next one uploads, reads it whole (8 M float32
    = 32 MB of 1.0), and redoes only step 2: finished work lost is the one step whose upload was cut."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from trsp_ray.common.filesystems import filesystem
    from trsp_ray.distributed.storage import RunRecords

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the loop lives in this test file
    private_ray(num_cpus=2)
    storage, run, payload = f"s3://trsp/upload?{s3['query']}", "inflight", 8 * 2**20
    fs, path = filesystem(storage)
    records = {"storage": storage, "run": run}
    fault = {"stage2_step": 2, "rank": 0, "upload": "in_flight", "marker": "fault-0"}
    TorchTrainer(_upload_loop, train_loop_config={"records": records, "fault": fault, "steps": 3, "payload": payload},
                 scaling_config=ScalingConfig(num_workers=1),
                 run_config=RunConfig(name=run, storage_path=path, storage_filesystem=fs,
                                      failure_config=FailureConfig(max_failures=1),
                                      checkpoint_config=CheckpointConfig(num_to_keep=2))).fit()
    events = RunRecords(storage, run).read()
    fired = json.loads(RunRecords(storage, run).marker("fault-0"))
    assert len(fired["pending"]) == 1  # step 2's staged save was still uploading when the worker died
    starts = [e for e in events if e["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, "step1"]
    assert starts[1]["work"] == [1] and starts[1]["payload"] == [payload, [1.0]]  # step 1's state, whole
    assert [e["step"] for e in events if e["event"] == "step"] == [1, 2, 2, 3]  # only step 2 done twice
    assert [e["work"] for e in events if e["event"] == "done"] == [[1, 2, 3]]
    # a save reported for a background upload says so: its record is not a resume point yet
    assert [(e["step"], e["upload"]) for e in events if e["event"] == "saved"] == [
        (1, "uploading"), (2, "uploading"), (2, "uploading"), (3, "uploading")]
    keys = [o["Key"] for page in s3["client"].get_paginator("list_objects_v2").paginate(Bucket="trsp", Prefix="upload/")
            for o in page.get("Contents", [])]
    print("checkpoint objects left:", sorted(k for k in keys if "/checkpoint-" in k))


def test_the_teacher_store_on_s3_is_read_back_by_a_second_row(s3):
    """Issue 50 item 2: an s3:// teacher store (checkpoint_dir on object storage) takes each shard as
    one object and a second row reads it instead of recomputing."""
    import torch
    from test_teacher_store import CFG, Counting, _fill, _stream

    from trsp_ray.models.tiny import tiny_model
    from trsp_ray.run.teacher_store import TeacherStore, store_root

    root = store_root(f"s3://trsp/ckpt?{s3['query']}")
    assert root == f"s3://trsp/ckpt/teacher?{s3['query']}"
    teacher = Counting(tiny_model("llama", layers=2, seed=0).eval())
    first = TeacherStore(root, _stream(), k=8, temperature=1.0, cfg=CFG, model="tiny", shard_windows=4)
    assert _fill(first, teacher, 6) == 2 and teacher.calls == 4
    listed = s3["client"].list_objects_v2(Bucket="trsp", Prefix="ckpt/teacher/")["Contents"]
    keys = sorted(o["Key"] for o in listed if not o["Key"].endswith("/"))  # pyarrow's directory marker aside
    assert keys == sorted(f"ckpt/teacher/{first.key(s)}.pt" for s in range(2))
    second = TeacherStore(root, _stream(), k=8, temperature=1.0, cfg=CFG, model="tiny", shard_windows=4)
    assert _fill(second, teacher, 6) == 0 and teacher.calls == 4
    assert torch.equal(second.records([5])[1], first.records([5])[1])
