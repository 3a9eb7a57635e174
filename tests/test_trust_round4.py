"""Trust, round 4 (issue 38): the marker is not the proof, numbers mean what they look like, no reader blocks.

* **What megashard owns is what it wrote**: a marker lists the files megashard wrote; ``--force`` refuses, naming
  them, anything else (a README.md put into an export, an edited config.json); a damaged marker is named as damaged;
  a corpus's metadata lists its files, so a user's ``PREFIX.tokenizer.json`` beside it is never replaced.
* **Numbers**: YAML and overrides read by YAML 1.2's core schema (``0100`` = 100, ``1:30``/``yes`` text, ``.inf``
  refused by number fields), yes/no/on/off taken by true/false fields.
* **Python API types**: ``initialize_model_parallel``, ``initialize``, ``ParallelConfig``, the advisor's and the
  doctor's functions refuse a str/float/None where a bool or int goes, naming the argument.
* **Messages**: advice that can be followed (rank_offset past the world), every setting that blocks an elastic
  world named, invisible characters escaped, a flag given but unused said so.
* **Readers**: every reader of a user's file checks it is a regular file of sane size before opening it for reading
  (a FIFO blocked ``megashard doctor`` forever); a range of thousands of node counts is summarised.

CLI cases run ``megashard.cli.main`` in this process; files are real, the Python API runs on a ``fake`` world.
"""
from __future__ import annotations

import json
import os

import pytest

from megashard.cli import main
from megashard.errors import ConfigError, DataError, MegashardError
from tests._helpers import tree_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")


def _one_line(capsys, code: int, prefix: str = "megashard ") -> str:
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err[-2000:]
    return lines[0]


# ---------------------------------------------------------------------------------------------- ownership
def _export_like(path) -> str:
    """A directory as `ckpt export-hf` leaves it: marked, its files written and listed in the marker."""
    from megashard.outputs import MARKER, claim_dir, record_files

    claim_dir(str(path), "hf-export")
    (path / "config.json").write_text('{"model_type": "gpt2"}\n')
    (path / "generation_config.json").write_text('{"do_sample": false}\n')
    (path / "model.safetensors").write_bytes(b"\0" * 4096)
    record_files(str(path), [n for n in os.listdir(path) if n != MARKER])
    return str(path)


def _force(path: str) -> None:
    from megashard.outputs import check_output_dir

    check_output_dir("OUT", path, kind="hf-export", replace=True)


def test_force_replaces_only_what_the_marker_lists(tmp_path):
    out = _export_like(tmp_path / "hf")
    _force(out)  # nothing but megashard's files: replaceable
    (tmp_path / "hf" / "README.md").write_text("my notes\n")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}\n")
    before = tree_snapshot(out)
    with pytest.raises(ConfigError, match=r"OUT .*/hf: holds what megashard did not write there: README.md, "
                                          r"tokenizer.json \(judged by its marker's list"):
        _force(out)
    assert tree_snapshot(out) == before


@pytest.mark.parametrize("change,named", [
    (lambda p: (p / "config.json").write_text('{"model_type": "gpt2", "mine": 1}\n'), "config.json (changed)"),
    (lambda p: (p / "model.safetensors").write_bytes(b"my weights"), "model.safetensors (changed)"),
    (lambda p: (p / "notes").mkdir(), "notes/"),
    (lambda p: os.symlink("/etc/hostname", p / "link.json"), "link.json"),
])
def test_force_refuses_an_edited_or_added_entry(tmp_path, change, named):
    out = _export_like(tmp_path / "hf")
    change(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"holds what megashard did not write there: " + named.replace("(", r"\(")
                       .replace(")", r"\)")):
        _force(out)


def test_a_marker_of_an_earlier_megashard_judges_by_name(tmp_path):
    """Markers written before file lists: only the names export-hf writes count as megashard's (docs/hf.md)."""
    from megashard.outputs import MARKER

    out = _export_like(tmp_path / "hf")
    doc = json.loads((tmp_path / "hf" / MARKER).read_text())
    doc.pop("files")
    (tmp_path / "hf" / MARKER).write_text(json.dumps(doc))
    _force(out)
    (tmp_path / "hf" / "README.md").write_text("mine\n")
    with pytest.raises(ConfigError, match=r"README.md \(judged by the names megashard writes in a Hugging Face model "
                                          r"directory.*lists no files\)"):
        _force(out)


@pytest.mark.parametrize("damage,why", [
    (lambda p: p.write_text("{not json"), "is not valid JSON"),
    (lambda p: (p.unlink(), os.mkfifo(p)), "is a FIFO"),
    (lambda p: (p.unlink(), p.mkdir()), "is a directory"),
    (lambda p: p.write_text('{"tool": "megashard", "holds": ["hf-export"], "files": ["config.json"]}'),
     "has a file list"),
    (lambda p: p.write_text('{"tool": "megashard", "holds": []}'), "has no list of kinds"),
])
def test_a_damaged_marker_is_named_as_damaged(tmp_path, damage, why):
    from megashard.outputs import MARKER, check_output_dir

    out = _export_like(tmp_path / "hf")
    damage(tmp_path / "hf" / MARKER)
    before = tree_snapshot(out)
    for kind, replace in (("hf-export", True), ("run", False)):
        with pytest.raises(ConfigError) as e:
            check_output_dir("OUT", out, kind=kind, replace=replace)
        assert f"its marker {MARKER} is damaged ({why}" in str(e.value) and "delete .megashard-dir.json" in str(e.value)
    assert tree_snapshot(out) == before


def test_the_marker_keeps_its_file_list_when_a_kind_is_added(tmp_path):
    from megashard.outputs import MARKER, claim_dir, record_files

    claim_dir(str(tmp_path / "r"), "run")
    (tmp_path / "r" / "a.txt").write_text("x")
    record_files(str(tmp_path / "r"), ["a.txt"])
    claim_dir(str(tmp_path / "r"), "checkpoints")
    doc = json.loads((tmp_path / "r" / MARKER).read_text())
    assert doc["holds"] == ["run", "checkpoints"] and doc["files"] == {"a.txt": {
        "size": 1, "sha256": "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"}}


@pytest.fixture
def texts(tmp_path):
    (tmp_path / "a.txt").write_text("".join(f"some words of text number {i} and more words\n" for i in range(200)))
    return tmp_path


def test_prepare_never_replaces_a_users_file_beside_its_corpus(texts, capsys):
    """Before: `data prepare --train-tokenizer 300 --out c` replaced the user's own c.tokenizer.json."""
    a, c = str(texts / "a.txt"), str(texts / "c")
    assert main(["data", "prepare", a, "--out", c, "-q"]) == 0  # byte-level: no tokenizer file
    meta = json.loads((texts / "c.meta.json").read_text())
    assert sorted(meta["files"]) == ["c.bin", "c.idx"] and meta["files"]["c.bin"]["size"] == os.path.getsize(c + ".bin")
    (texts / "c.tokenizer.json").write_text('{"mine": 1}')
    before = tree_snapshot(str(texts))
    capsys.readouterr()
    line = _one_line(capsys, main(["data", "prepare", a, "--out", c, "--train-tokenizer", "300", "-q"]))
    assert f"--out {c}.tokenizer.json: exists and is not one of the files c.meta.json lists" in line
    assert tree_snapshot(str(texts)) == before
    assert main(["data", "prepare", a, "--out", c, "-q"]) == 0  # a byte corpus again: the file of that name stays
    assert (texts / "c.tokenizer.json").read_text() == '{"mine": 1}'
    (texts / "c.tokenizer.json").unlink()
    assert main(["data", "prepare", a, "--out", c, "--train-tokenizer", "300", "-q"]) == 0
    assert main(["data", "prepare", a, "--out", c, "--train-tokenizer", "320", "-q"]) == 0  # its own: replaced
    (texts / "c.bin").write_bytes(b"my own binary data")
    before = tree_snapshot(str(texts))
    capsys.readouterr()
    line = _one_line(capsys, main(["data", "prepare", a, "--out", c, "-q"]))
    assert f"--out {c}.bin: exists and was changed since megashard prepared it" in line
    assert tree_snapshot(str(texts)) == before


def test_prepare_with_metadata_of_an_earlier_megashard(texts, capsys):
    a, c = str(texts / "a.txt"), str(texts / "c")
    assert main(["data", "prepare", a, "--out", c, "-q"]) == 0
    meta = json.loads((texts / "c.meta.json").read_text())
    meta.pop("files")
    (texts / "c.meta.json").write_text(json.dumps(meta))
    (texts / "c.tokenizer.json").write_text('{"mine": 1}')
    capsys.readouterr()
    line = _one_line(capsys, main(["data", "prepare", a, "--out", c, "--train-tokenizer", "300", "-q"]))
    assert "c.meta.json names tokenizer 'byte', not it: it is not the corpus's" in line
    assert (texts / "c.tokenizer.json").read_text() == '{"mine": 1}'


# ---------------------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("text,value", [
    ("0100", 100), ("00000010", 10), ("09", 9), ("-0012", -12), ("+5", 5), ("1_000", 1000), ("0x1F", 31),
    ("0o17", 15), ("1.5", 1.5), (".5", 0.5), ("3e-4", 3e-4), ("1_000.5", 1000.5), ("true", True), ("FALSE", False),
    ("~", None), ("null", None), ("", None),
    # text, as written (YAML 1.1 would read 90, 5, a date, booleans)
    ("1:30", "1:30"), ("0b101", "0b101"), ("1__0", "1__0"), ("2024-01-02", "2024-01-02"), ("yes", "yes"),
    ("no", "no"), ("on", "on"), ("Off", "Off"), ("y", "y"), ("=", "="),
])
def test_a_yaml_value_means_what_it_looks_like(text, value):
    from megashard.config.yamlfile import parse_yaml

    got = parse_yaml(text, "x")
    assert got == value and type(got) is type(value), (text, got)


def test_infinity_and_nan_are_floats_that_number_fields_refuse():
    import math

    from megashard.config.yamlfile import parse_yaml

    assert parse_yaml(".inf", "x") == math.inf and math.isnan(parse_yaml(".nan", "x"))
    with pytest.raises(ConfigError, match=r"not an integer megashard can read"):
        parse_yaml("9" * 5000, "x")


def _job(*overrides, tail: str = "", tmp_path=None):
    from megashard.train.config import JobConfig

    path = DEFAULT
    if tail:  # a job of its own: these sections, the defaults elsewhere
        path = str(tmp_path / "job.yaml")
        with open(path, "w") as f:
            f.write(tail + "\n")
    job = JobConfig.from_yaml(path, list(overrides))
    job.validate_sections()
    return job


def test_numbers_with_leading_zeros_are_decimal_in_overrides_and_files(tmp_path):
    """Before: train.steps=0100 trained 64 steps, checkpoint.load_step=00000010 meant step 8."""
    job = _job("train.steps=0100", "checkpoint.load_step=00000010", "checkpoint.interval=010", "parallel.seed=0017")
    assert (job.train.steps, job.checkpoint.load_step, job.checkpoint.interval, job.parallel.seed) == (100, 10, 10, 17)
    job = _job(tail="train: {steps: 0100}\nparallel: {seed: 0o17}", tmp_path=tmp_path)
    assert (job.train.steps, job.parallel.seed) == (100, 15)
    job = _job("train.progress=no", "parallel.create_gloo_process_groups=off", "launch.rdzv_id=yes")
    assert (job.train.progress, job.parallel.create_gloo_process_groups, job.launch.rdzv_id) == (False, False, "yes")


@pytest.mark.parametrize("override,message", [
    ("train.steps=1:30", "train.steps='1:30' must be an integer"),
    ("train.steps=yes", "train.steps='yes' must be an integer"),
    ("train.steps=~", "train.steps=null is not allowed; give an integer"),
    ("train.steps=1e3", "train.steps=1000.0 must be an integer"),
    ("train.steps=0b101", "train.steps='0b101' must be an integer"),
    ("optim.lr=.inf", "optim.lr=inf must be a finite number"),
    ("optim.lr=.nan", "optim.lr=nan must be a finite number"),
    ("optim.lr='inf'", "optim.lr='inf' must be a number"),
    ("model.dropout=-.inf", "model.dropout=-inf must be a finite number"),
    ("parallel.timeout=.inf", "timeout=inf must be a positive number of seconds"),
    ("train.dtype=off", "train.dtype='off' is not supported"),
    ("launch.rdzv_id=0123", "launch.rdzv_id=123 must be a string (YAML read a number here; quote it"),
    ("train.progress=maybe", "train.progress='maybe' must be true or false"),
])
def test_a_value_that_is_no_number_of_the_field_is_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        _job(override)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_python_callers_get_no_yes_words():
    """yes/no/on/off are YAML's spellings: a Python bool argument must be a bool."""
    from megashard.config import ParallelConfig

    assert ParallelConfig.from_dict({"hybrid_context_parallel": "no"}, yaml_words=True).hybrid_context_parallel is False
    for bad in (dict(hybrid_context_parallel="no"), dict(create_gloo_process_groups="yes")):
        with pytest.raises(ConfigError, match=f"{next(iter(bad))}='.*' must be true or false"):
            ParallelConfig(**bad)
        with pytest.raises(ConfigError, match="must be true or false"):
            ParallelConfig.from_dict(bad)


# ---------------------------------------------------------------------------------------------- API types
@pytest.fixture
def fake4():
    import torch.distributed as dist

    from megashard._compat import fake_store

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=4)
    yield
    import megashard.parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.parametrize("kw,message", [
    (dict(use_sharp="no"), "use_sharp='no' (type str) must be True or False"),
    (dict(use_sharp=1), "use_sharp=1 (type int) must be True or False"),
    (dict(hybrid_context_parallel="false"), "hybrid_context_parallel='false' (type str) must be True or False"),
    (dict(create_gloo_process_groups=None), "create_gloo_process_groups=None must be True or False"),
    (dict(tensor_model_parallel_size="2"), "tensor_model_parallel_size='2' (type str) must be an integer >= 1"),
    (dict(tensor_model_parallel_size=2.0), "tensor_model_parallel_size=2.0 (type float) must be an integer >= 1"),
    (dict(pipeline_model_parallel_size=True), "pipeline_model_parallel_size=True (type bool) must be an integer"),
    (dict(virtual_pipeline_model_parallel_size="2"), "virtual_pipeline_model_parallel_size='2' (type str) must be an "
                                                     "integer >= 1 or None"),
    (dict(expert_tensor_parallel_size=1.0), "expert_tensor_parallel_size=1.0 (type float)"),
    (dict(distributed_timeout_minutes="30"), "distributed_timeout_minutes='30' (type str) must be a finite number > 0"),
    (dict(distributed_timeout_minutes=float("nan")), "distributed_timeout_minutes=nan"),
    (dict(rank_offset=None), "rank_offset=None must be an integer >= 0"),
    (dict(local_world_size=2.0), "local_world_size=2.0 (type float)"),
    (dict(order=None), "order=None must be a string"),
    (dict(hierarchical_context_parallel_sizes="22"), "hierarchical_context_parallel_sizes='22' (type str) must be a "
                                                     "list of integers or None"),
    (dict(high_priority_stream_groups="dp"), "high_priority_stream_groups='dp' (type str) must be a list of strings"),
    (dict(sharp_enabled_group=1), "sharp_enabled_group=1 (type int) must be a string or None"),
    (dict(nccl_communicator_config_path=5), "nccl_communicator_config_path=5 (type int)"),
    (dict(get_embedding_ranks=3), "get_embedding_ranks=3 (type int) must be a callable or None"),
])
def test_initialize_model_parallel_refuses_a_wrong_type_naming_the_argument(fake4, kw, message):
    """Before: use_sharp="no" switched SHARP on (sharp_group='dp')."""
    import megashard.parallel_state as ps

    with pytest.raises(ConfigError) as e:
        ps.initialize_model_parallel(**kw)
    assert str(e.value) == "initialize_model_parallel: " + message or message in str(e.value), str(e.value)
    assert not ps.model_parallel_is_initialized()


def test_rank_offset_past_the_world_gets_advice_that_can_be_followed(fake4):
    """Before: rank_offset=5 on 4 ranks advised "give local_world_size <= -1"."""
    import megashard.parallel_state as ps

    with pytest.raises(ConfigError, match=r"rank_offset=5 is past the last rank of the 4-rank default group; give "
                                          r"rank_offset in 0..3") as e:
        ps.initialize_model_parallel(rank_offset=5)
    assert "-1" not in str(e.value)


@pytest.mark.parametrize("call,message", [
    (lambda m: m.initialize("tp=2"), "initialize: config='tp=2' (type str) must be a ParallelConfig"),
    (lambda m: m.initialize(rank_offset="1", tp=1), "initialize: rank_offset='1' (type str) must be an integer >= 0"),
    (lambda m: m.initialize(agree_on=[1], tp=1), "initialize: agree_on=[1] (type list) must be a mapping"),
    (lambda m: m.initialize(tp="2"), "tp='2' must be an integer"),
])
def test_initialize_refuses_a_wrong_type(call, message):
    import megashard

    with pytest.raises(ConfigError) as e:
        call(megashard)
    assert message in str(e.value)
    assert not megashard.is_initialized()


def test_the_advisors_and_doctors_functions_check_their_arguments(tmp_path):
    import megashard.doctor as doctor
    from megashard.advisor.calibrate import load_calibration
    from megashard.advisor.report import format_suggestion, suggestion_dict
    from megashard.advisor.search import suggest
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(DEFAULT)
    cases = [
        (lambda: suggest(job, "8", "80GiB"), "world_size='8'"),
        (lambda: suggest(job, 8, "80GiB", ranks_per_node=8.0), "ranks_per_node=8.0"),
        (lambda: suggest(job, 8, "80GiB", shape="x"), "shape='x': must be a megashard.advisor.shape.JobShape"),
        (lambda: load_calibration(str(tmp_path / "c.json"), None, "4"), "world_size='4'"),
        (lambda: load_calibration(None, None, 4), "load_calibration: path=None must be a file path"),
        (lambda: doctor.read_run_dir(None), "read_run_dir: path=None (type NoneType) must be a directory path"),
        (lambda: doctor.read_attempts(5), "read_attempts: path=5 (type int) must be a directory path"),
        (lambda: doctor.attempt_dirs(b"x"), "attempt_dirs: path=b'x'"),
        (lambda: doctor.summarize([1]), "summarize: records=[1] must be a mapping"),
        (lambda: doctor.format_table({}), "format_table: summary={} must be what summarize() returns"),
        (lambda: doctor.set_step("3"), "set_step(step='3'): step must be an integer >= 0"),
        (lambda: doctor.register(None, 5), "register(name=5): name must be a non-empty string"),
        (lambda: doctor.disable(None), "disable(reason=None): reason must be 'exit', 'failure' or 'world_change'"),
    ]
    result = suggest(job, 4, "80GiB")
    cases += [(lambda: format_suggestion(result, "3"), "top='3'"), (lambda: suggestion_dict(result, 0), "top=0")]
    for call, message in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert message in str(e.value), (message, str(e.value))


# ---------------------------------------------------------------------------------------------- messages
def test_every_setting_that_blocks_an_elastic_world_is_named(capsys):
    """Before: only world 6's reason (global_batch over dp) was said, never train.microbatches (worlds 2 and 4)."""
    line = _one_line(capsys, main(["plan", DEFAULT, "launch.nnodes=1:3", "train.microbatches=3",
                                   "launch.nproc_per_node=2"]))
    assert "at world size 6: train.global_batch=16 must divide by the data-parallel size dp=3" in line
    assert ("at world size 4: train.global_batch=16 must divide by train.microbatches × dp = 3 × 2 = 6" in line
            and "(alike at world size 2)" in line)


@pytest.mark.parametrize("text,shown", [
    ("parallel:\n  tp\u00a0: 2\n", r"'parallel.tp\xa0' (an invisible character in 'parallel.tp': retype the key)"),
    ("parallel:\n  t\u200bp: 2\n", r"'parallel.t\u200bp' (an invisible character in 'parallel.tp'"),
    ("parallel\u00a0:\n  tp: 2\n", r"'parallel\xa0' (an invisible character in 'parallel'"),
    ("train:\n  st\ufeffeps: 2\n", r"'train.st\ufeffeps' (an invisible character in 'train.steps'"),
])
def test_invisible_characters_in_a_key_are_shown_escaped(tmp_path, capsys, text, shown):
    """Before: "unknown key 'parallel.tp' (did you mean 'parallel.tp'?)"."""
    p = tmp_path / "j.yaml"
    p.write_text(text, encoding="utf-8")
    line = _one_line(capsys, main(["plan", str(p)]))
    assert shown in line, line


def test_an_override_key_with_an_invisible_character(capsys):
    line = _one_line(capsys, main(["plan", DEFAULT, "parallel.t\u200bp=2"]))
    assert r"'parallel.t\u200bp' (an invisible character in 'parallel.tp'" in line


@pytest.mark.parametrize("flag,value", [("--calibrate-steps", "5"), ("--calibrate-rounds", "2"),
                                        ("--calibrate-steps", "7")])
def test_a_calibration_flag_without_calibrate_is_said_unused(capsys, flag, value):
    """Before: --calibrate-steps 5 (the default) without --calibrate was silently ignored."""
    line = _one_line(capsys, main(["plan", DEFAULT, "--suggest", "--world-size", "4", "--device-memory", "80GiB",
                                   flag, value]))
    assert f"{flag} only applies with --calibrate (given: {value}" in line


def _calibration(path, **change) -> str:
    from megashard.advisor.calibrate import KIND, VERSION, fingerprint
    from megashard.advisor.shape import JobShape
    from megashard.train.config import JobConfig

    doc = {"kind": KIND, "version": VERSION, "world_size": 4,
           "shape": fingerprint(JobShape.from_job(JobConfig.from_yaml(DEFAULT))),
           "timings": [{"layout": "tp=99 (no such layout)", "overrides": [], "step_s": 1.0, "samples": [1.0]}]}
    doc.update(change)
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_calibration_file_is_named_damaged_or_unused(tmp_path, capsys):
    """Before: world_size "4" got "measured for 4 ranks, not --world-size 4"; a file matching no layout was
    silently unused."""
    suggest_cmd = ["plan", DEFAULT, "--suggest", "--world-size", "4", "--device-memory", "80GiB", "--trace", "0",
                   "--calibration"]
    line = _one_line(capsys, main(suggest_cmd + [_calibration(tmp_path / "a.json", world_size="4")]))
    assert "its world_size is '4' (str), not a positive integer: the file is damaged" in line
    assert main(suggest_cmd + [_calibration(tmp_path / "b.json")]) == 0
    err = capsys.readouterr().err
    assert "none of its 1 timed layout(s) is among this job's layouts, so it is unused" in err


# ---------------------------------------------------------------------------------------------- readers
@pytest.mark.parametrize("make,why", [
    (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
    (lambda p: os.mkdir(p), "is a directory"),
    (lambda p: open(p, "wb").truncate(17 << 20), "is 17.0 MiB, more than the 16.0 MiB such a file can be"),
    (lambda p: os.symlink("/dev/zero", p), "is a character device, not a regular file"),
    (lambda p: None, "no such file"),
])
def test_the_reader_never_blocks_nor_reads_a_huge_file(tmp_path, make, why):
    from megashard.readers import read_json

    p = str(tmp_path / "f.json")
    make(p)
    with pytest.raises(DataError) as e:
        read_json(p, "record", error=DataError)
    assert str(e.value).startswith(f"record {p}: {why}"), str(e.value)


def test_doctor_of_a_run_directory_with_a_fifo_record(tmp_path, capsys):
    """Before: `megashard doctor RUN_DIR` blocked forever in open() on a FIFO rank_0.json."""
    os.makedirs(tmp_path / "doctor")
    os.mkfifo(tmp_path / "doctor" / "rank_0.json")
    main(["doctor", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "rank_0.json: is a FIFO (named pipe), not a regular file" in out + err


@pytest.mark.parametrize("where", ["calibration", "meta", "config", "tokenizer", "input", "data"])
def test_a_fifo_anywhere_a_user_names_a_file_is_refused(tmp_path, capsys, where):
    fifo = str(tmp_path / "f")
    os.mkfifo(fifo)
    (tmp_path / "a.txt").write_text("text of mine\n" * 20)
    argv = {
        "calibration": ["plan", DEFAULT, "--suggest", "--world-size", "4", "--device-memory", "80GiB",
                        "--calibration", fifo],
        "config": ["plan", fifo],
        "tokenizer": ["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "c"), "--tokenizer", fifo],
        "input": ["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "c")],
        "data": ["run", DEFAULT, "--dry-run", "data.source=indexed", f"data.path={fifo}",
                 f"train.out_dir={tmp_path}/r"],
        "meta": ["data", "inspect", str(tmp_path / "c")],
    }[where]
    if where == "meta":
        assert main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "c"), "-q"]) == 0
        os.remove(tmp_path / "c.meta.json")
        os.mkfifo(tmp_path / "c.meta.json")
        capsys.readouterr()
    if where == "input":  # a FIFO found in an input directory, beside a text file
        os.makedirs(tmp_path / "in")
        os.rename(tmp_path / "a.txt", tmp_path / "in" / "a.txt")
        os.mkfifo(tmp_path / "in" / "f")
    code = main(argv)
    out, err = capsys.readouterr()
    if where == "input":  # left out, said in a note; the corpus is the text file's
        assert code == 0 and "left out 1 empty or binary file" in err, (code, err)
        return
    assert code == 2 and ("FIFO" in err or "not a regular file" in err) and "Traceback" not in err, (code, err)


def test_a_range_of_thousands_of_node_counts_is_summarised(capsys):
    """Before: launch.nnodes=1:20000 printed one line per node count (4.3 MB)."""
    assert main(["plan", DEFAULT, "launch.nnodes=1:3000"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 60 and "… 2,970 more node counts (21..2990) not listed: 0 run" in out
    assert "2,996 world sizes are refused: at world size 12000: train.global_batch=16 must divide by the data-parallel" \
           in out
    line = _one_line(capsys, main(["plan", DEFAULT, "launch.nnodes=1:1000000"]))
    assert "launch.nnodes=1:1000000 spans 1,000,000 node counts; an elastic range may span at most 65,536" in line


def test_every_reader_goes_through_the_shared_helper():
    """No module that reads a user's small file opens it with a bare open() for reading whole: they use
    megashard.readers (checked by name for the readers this round fixed)."""
    import inspect

    import megashard.advisor.calibrate as calibrate
    import megashard.checkpoint.safety as safety
    import megashard.config.nccl as nccl
    import megashard.config.yamlfile as yamlfile
    import megashard.data.corpus as corpus
    import megashard.doctor.records as records
    import megashard.outputs as outputs
    import megashard.train.hf_dir as hf_dir

    for fn in (records.read_run_dir, calibrate._read, yamlfile.load_yaml, nccl.parse_nccl_config, corpus.read_meta,
               safety.read_json, outputs._read_marker, hf_dir._weight_map):
        src = inspect.getsource(fn)
        assert "read_json" in src or "read_bytes" in src or "read_text" in src, fn.__qualname__
        assert "open(" not in src.replace("os.open(", "").replace("safe_open(", ""), fn.__qualname__
