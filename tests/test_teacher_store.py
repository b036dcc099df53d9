"""Issue 50 item 2: distillation from a stored teacher. The dense model's top-k records of each heal
window are computed once and read by every later row (never recomputed); another text, k or
sequence length misses; with k = V the stored loss is today's full-vocabulary DistillLoss."""

from __future__ import annotations

import pytest
import torch

from trsp_ray.common.errors import TrspError
from trsp_ray.data.calibration import SourceText
from trsp_ray.data.stream import HealStream
from trsp_ray.method.distill import StoredDistillLoss, teacher_topk, topk_kl
from trsp_ray.method.training import DistillLoss
from trsp_ray.models.tiny import VOCAB, tiny_model
from trsp_ray.plan.teacher_plan import bytes_per_token
from trsp_ray.run.teacher_store import TeacherStore, dense_compute

CFG = {"device": "cpu", "dtype": "fp32"}  # content.store_key reads the precision from it


def _stream(*, seqlen: int = 17, text_seed: int = 0, batch_size: int = 2) -> HealStream:
    gen = torch.Generator().manual_seed(text_seed)
    sources = {name: SourceText(name=name, ids=torch.randint(0, VOCAB, (400,), generator=gen), starts=[0, 200])
               for name in ("a", "b")}
    return HealStream(sources, {"a": 0.6, "b": 0.4}, seqlen=seqlen, batch_size=batch_size, bos=None, seed=3)


class Counting:
    """A teacher whose forwards are counted."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def parameters(self):
        return self.model.parameters()

    def __call__(self, **kwargs):
        self.calls += 1
        return self.model(**kwargs)


def _store(tmp_path, stream, *, k: int = 8, shard_windows: int = 4, temperature: float = 2.0) -> TeacherStore:
    return TeacherStore(str(tmp_path / "teacher"), stream, k=k, temperature=temperature, cfg=CFG, model="tiny-llama",
                        shard_windows=shard_windows)


def _fill(store: TeacherStore, teacher: Counting, windows: int) -> int:
    return store.fill(dense_compute(teacher, k=store.k, temperature=store.temperature,
                                    batch_size=store.stream.batch_size), windows=windows)


def test_a_second_row_reads_the_stored_teacher_and_never_recomputes_it(tmp_path, capsys):
    teacher = Counting(tiny_model("llama", layers=2, seed=0).eval())
    first = _store(tmp_path, _stream())
    assert _fill(first, teacher, 10) == 3  # shards of 4 windows: 0-3, 4-7, 8-11
    progress = [line for line in capsys.readouterr().out.splitlines() if "teacher pass: shard" in line]
    assert [line.split("shard ")[1] for line in progress] == ["1/3 (4 windows)", "2/3 (4 windows)",
                                                             "3/3 (4 windows)"]  # the pass shows it moving
    assert teacher.calls == 6  # 12 windows in batches of 2
    assert sorted(p.name for p in (tmp_path / "teacher").glob("*.pt")) == sorted(
        first.path(s).rsplit("/", 1)[1] for s in range(3))
    assert not list((tmp_path / "teacher").glob(".tmp-*"))  # written atomically: no temp left behind

    second = _store(tmp_path, _stream())  # another row, the same stream: every shard read
    assert _fill(second, teacher, 10) == 0 and teacher.calls == 6
    assert _fill(second, teacher, 14) == 1 and teacher.calls == 8  # a longer heal computes only its new shard

    # what the second row reads is what the teacher gives on those windows
    second.stream.next(), second.stream.next()  # batches of windows 0-1 and 2-3
    logp, index, tail = second.lookup()
    with torch.no_grad():
        logits = teacher.model(input_ids=torch.stack([second.stream.window(k) for k in (2, 3)])).logits
    want = teacher_topk(logits, k=8, temperature=2.0)
    assert torch.equal(logp, want[0]) and torch.equal(index, want[1]) and torch.equal(tail, want[2])
    assert logp.dtype == torch.float16 and index.dtype == torch.int32 and tail.dtype == torch.float16
    rank1 = second.lookup(slice(1, 2))  # a data-parallel rank's rows of the batch
    assert torch.equal(rank1[0], logp[1:2])


@pytest.mark.parametrize("change", ["text", "k", "seqlen", "temperature"])
def test_another_text_k_or_sequence_length_misses(tmp_path, change):
    teacher = Counting(tiny_model("llama", layers=2, seed=0).eval())
    base = _store(tmp_path, _stream())
    _fill(base, teacher, 8)
    stream = _stream(text_seed=1 if change == "text" else 0, seqlen=19 if change == "seqlen" else 17)
    other = _store(tmp_path, stream, k=9 if change == "k" else 8, temperature=1.0 if change == "temperature" else 2.0)
    assert other.missing(8) == [0, 1]
    assert {other.key(s) for s in range(2)}.isdisjoint({base.key(s) for s in range(2)})
    same = _store(tmp_path, _stream())
    assert same.missing(8) == [] and same.key(0) == base.key(0)


def test_with_k_the_whole_vocabulary_the_stored_loss_is_the_full_distillation_loss():
    teacher = tiny_model("llama", layers=2, seed=0).eval()
    student = tiny_model("llama", layers=2, seed=1)
    batch = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    full = DistillLoss(teacher, temperature=2.0)(student, batch).detach()
    with torch.no_grad():
        t_logits = teacher(input_ids=batch).logits
    records = teacher_topk(t_logits, k=VOCAB, temperature=2.0)
    assert torch.isneginf(records[2]).all()  # nothing outside the top V
    stored = StoredDistillLoss(lambda rows: records, temperature=2.0)(student, batch)
    # fp16 log-probabilities: the stored teacher differs from the exact one by its rounding only
    assert float(stored.detach()) == pytest.approx(float(full), rel=2e-3)
    exact = topk_kl(student(input_ids=batch).logits, torch.log_softmax(t_logits / 2.0, -1),
                    torch.arange(VOCAB).expand(3, 16, VOCAB), torch.full((3, 16), float("-inf")), temperature=2.0)
    assert float(exact.detach()) == pytest.approx(float(full), rel=1e-6)  # exact records: the same loss
    # the gradient through the tail bin is finite when the top k hold all the mass
    stored.backward()
    assert all(torch.isfinite(p.grad).all() for p in student.parameters() if p.grad is not None)


def test_a_wrong_student_raises_the_loss_and_the_tail_bin_counts():
    teacher = tiny_model("llama", layers=2, seed=0).eval()
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        records = teacher_topk(teacher(input_ids=batch).logits, k=8, temperature=1.0)
    loss = StoredDistillLoss(lambda rows: records)
    with torch.no_grad():
        itself, other = float(loss(teacher, batch)), float(loss(tiny_model("llama", layers=2, seed=1), batch))
    assert abs(itself) < 1e-5 and other > 1e-3  # a random tiny model is nearly uniform: small KLs
    # a student that agrees on the top 8 but moves the tail's mass among its own tokens pays nothing
    # for that; one that moves mass from the tail into the top 8 pays through the tail bin
    logp, index, tail = records
    with torch.no_grad():
        s_logits = torch.log_softmax(teacher(input_ids=batch).logits, -1)
        boosted = s_logits.scatter_add(-1, index.long(), torch.full(index.shape, 0.5))
    assert float(topk_kl(boosted, logp, index, tail, temperature=1.0)) > 1e-3


def test_the_cross_entropy_weight_adds_the_next_token_loss():
    teacher = tiny_model("llama", layers=2, seed=0).eval()
    student = tiny_model("llama", layers=2, seed=1).eval()
    batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        records = teacher_topk(teacher(input_ids=batch).logits, k=8, temperature=1.0)
        kl = float(StoredDistillLoss(lambda rows: records)(student, batch))
        both = float(StoredDistillLoss(lambda rows: records, ce_weight=0.5)(student, batch))
        ce = float(student(input_ids=batch, labels=batch).loss)
    assert both == pytest.approx(kl + 0.5 * ce, rel=1e-5)


def test_storage_per_token_and_the_settings_refused_in_one_line():
    from trsp_ray.config.run_config import load_config

    assert bytes_per_token(64) == 386 and bytes_per_token(1) == 8
    for bad, match in ((["recovery.kd_topk=-1"], "recovery.kd_topk=-1 is not valid"),
                       (["recovery.teacher=disk"], "recovery.teacher='disk' is not valid; choose one of auto, stored"),
                       (["recovery.kd_ce_weight=-0.5"], "recovery.kd_ce_weight=-0.5 is not valid"),
                       (["recovery.teacher=stored", "recovery.kd_topk=0"], "teacher=stored with recovery.kd_topk=0")):
        with pytest.raises(TrspError, match=match) as err:
            load_config(overrides=bad)
        assert "\n" not in str(err.value)


def test_a_kd_heal_on_the_heal_stream_distils_from_the_store_filled_once(tmp_path, monkeypatch):
    """methods.recovery_stepper: recovery.teacher=auto reads the store for a heal on the heal stream
    (the dense original fills it once), and stays live for stage 2 (no stream)."""
    from trsp_ray.config.run_config import load_config
    from trsp_ray.run import content
    from trsp_ray.run.methods import recovery_stepper
    from trsp_ray.run.workbench import Workbench

    monkeypatch.setattr(content, "model_fingerprint", lambda name: "tiny-llama")
    original = tiny_model("llama", layers=2, seed=0)
    calls = []
    original.register_forward_hook(lambda *a: calls.append(1))
    cfg = load_config(overrides=["recovery.objective=kd", "recovery.kd_topk=8", "heal.seqlen=17",
                                 f"checkpoint_dir={tmp_path}"])
    bench = Workbench(cfg=cfg, model=original, tokenizer=None, calib_ids=torch.arange(10), texts=None, device="cpu")
    student = tiny_model("llama", layers=1, seed=1)
    objective = recovery_stepper(bench, stream=_stream(), windows=6, model=student).keywords["objective"]
    assert isinstance(objective, StoredDistillLoss) and len(calls) == 32  # 64 windows (a shard) in batches of 2
    assert len(list((tmp_path / "teacher").glob("*.pt"))) == 1
    stream = _stream()
    again = recovery_stepper(bench, stream=stream, windows=6, model=student).keywords["objective"]
    assert len(calls) == 32  # the second row reads
    batch = stream.next()
    with torch.no_grad():
        records = teacher_topk(original(input_ids=batch).logits, k=8, temperature=1.0)
        assert float(again(student, batch)) == float(StoredDistillLoss(lambda rows: records)(student, batch))
    assert isinstance(recovery_stepper(bench).keywords["objective"], DistillLoss)  # stage 2: live
    live = load_config(overrides=["recovery.objective=kd", "recovery.teacher=live", "heal.seqlen=17"])
    bench_live = Workbench(cfg=live, model=original, tokenizer=None, calib_ids=torch.arange(10), texts=None,
                           device="cpu")
    assert isinstance(recovery_stepper(bench_live, stream=_stream(), windows=6).keywords["objective"], DistillLoss)


@pytest.mark.parametrize("rows, world, size", [(4, 2, 1), (3, 2, 1), (5, 2, 2), (2, 4, 1), (7, 3, 2)])
def test_the_ranks_records_join_back_in_the_windows_order(rows, world, size):
    """The workers' teacher pass: each rank's rows (training.split_over_ranks, a rank may have none)
    gathered back in the shard's window order (training.join_over_ranks)."""
    from trsp_ray.method.training import join_over_ranks, split_over_ranks

    windows = torch.arange(rows * 3).view(rows, 3)
    parts = []
    for rank in range(world):
        mine, _ = split_over_ranks(list(windows.split(size)), rank=rank, world=world)
        parts.append(torch.cat(mine) if mine else None)
    assert torch.equal(join_over_ranks(parts, rows=rows), windows)
