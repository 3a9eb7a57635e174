"""Trust, round 3 (issue 27): a user's files and data are never lost or silently changed, a dry run checks what the
real run will, every reader of a user's file checks types, the Python API checks what the CLI checks, one error line
per job.

* **Data loss** (each of these lost or overwrote the user's file before): ``ckpt export-hf CKPT . --force`` in a
  directory of the user's, ``run config.yaml train.out_dir=.``, ``ckpt consolidate CKPT notes.txt``, ``data prepare
  --out`` over a file of the user's, ``plan --svg`` over one, a ``.tmp-*`` of the user's in a checkpoint root. The
  outputs megashard makes are marked (:mod:`megashard.outputs`) and older ones recognised.
* **Data changed silently**: a symbolic link loop read 40 times, Latin-1 text turned into U+FFFD, a float token file
  read as ids.
* **Dry run**, **readers**, **Python API**, **one line per job**, and the CLI's own misreadings.

CLI cases run ``megashard.cli.main`` in this process (no process may start: ``subprocess`` is refused); the cases that
need a real checkpoint share one job trained here on two ranks for two steps; the one-line-per-job case starts a real
job that fails on its damaged checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megashard.cli import main
from megashard.errors import ConfigError, MegashardError
from tests._helpers import tree_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
TEXT = os.path.join(ROOT, "configs", "text.yaml")
HAS_SAFETENSORS = __import__("importlib.util").util.find_spec("safetensors") is not None


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_JOB_ID", None)
    return env


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*a, **k):  # pragma: no cover - reached only when a bad input got through
        raise AssertionError(f"a process was started: {a}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def _one_line(capsys, code: int, prefix: str) -> str:
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2, (code, err[-2000:])
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> str:
    """The user's files of the cases: {bad}/<name>."""
    d = tmp_path_factory.mktemp("trust3")
    (d / "home").mkdir()
    (d / "home" / "notes.txt").write_text("my notes\n")
    (d / "home" / "thesis").mkdir()
    (d / "home" / "thesis" / "ch1.tex").write_text("\\chapter{One}\n")
    (d / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve\n".encode("latin-1") * 20)
    (d / "utf8.txt").write_text("plain words of text, long enough to be a document\n" * 20)
    (d / "texts").mkdir()  # a directory of the user's texts: a corpus written into it would be read as text next time
    (d / "texts" / "a.txt").write_text("a document of the user's\n" * 20)
    (d / "tok").mkdir()
    (d / "f32.bin").write_bytes(bytes(torch.full((4096,), 0.5).view(torch.uint8).tolist()))  # float32 "tokens"
    (d / "cfg").mkdir()
    (d / "cfg" / "config.yaml").write_text("# my comments, which must survive\n" + open(DEFAULT).read())
    (d / "notes.bin").write_text("a file of the user's that happens to end in .bin\n")
    (d / "picture.svg").write_text("<svg><title>my own drawing</title></svg>\n")
    # Hugging Face directories (config.json only: every check here comes before a tensor is read)
    gpt = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64,
           "activation_function": "gelu", "tie_word_embeddings": False}
    for name, doc in (("hf-list", [1, 2]), ("hf-str", {**gpt, "n_embd": "64"}),
                      ("hf-missing", {k: v for k, v in gpt.items() if k != "n_layer"}),
                      ("hf-null", {**gpt, "n_layer": None}), ("hf-bool", {**gpt, "n_head": True})):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(doc))
    (d / "hf-wm").mkdir()
    (d / "hf-wm" / "config.json").write_text(json.dumps(gpt))
    (d / "hf-wm" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a", "b"]}))
    (d / "hf-wm-out").mkdir()
    (d / "hf-wm-out" / "config.json").write_text(json.dumps(gpt))
    (d / "hf-wm-out" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "../../etc/passwd"}}))
    from megashard.data.prepare import prepare

    prepare([str(d / "utf8.txt")], str(d / "c"), progress=False)
    meta = json.loads((d / "c.meta.json").read_text())
    shutil.copy(d / "c.bin", d / "nt.bin")
    shutil.copy(d / "c.idx", d / "nt.idx")
    (d / "nt.meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "tokenizer"}))
    shutil.copy(d / "c.bin", d / "ml.bin")
    shutil.copy(d / "c.idx", d / "ml.idx")
    (d / "ml.meta.json").write_text("[]")
    return str(d)


def _fmt(argv: list, bad: str) -> list:
    return [a.replace("{bad}", bad) for a in argv]


RUN = ["run", DEFAULT, "--dry-run"]
# (id, argv after `megashard`, text the one error line must contain)
CLI = [
    # nothing of the user's is overwritten
    ("run-out-dir-holds-config", ["run", "{bad}/cfg/config.yaml", "train.out_dir={bad}/cfg"],
     "is the config file {bad}/cfg/config.yaml this command reads: it would be overwritten"),
    ("run-out-dir-foreign", RUN + ["train.out_dir={bad}/home"],
     "the existing directory holds notes.txt, thesis, not made by megashard"),
    ("run-ckpt-dir-foreign", RUN + ["train.out_dir={bad}/newrun", "checkpoint.dir={bad}/home"],
     "checkpoint.dir='{bad}/home': the existing directory holds notes.txt, thesis"),
    ("prepare-over-user-file", ["data", "prepare", "{bad}/utf8.txt", "--out", "{bad}/notes"],
     "--out {bad}/notes.bin: exists and is not part of a corpus megashard prepared"),
    ("prepare-out-inside-input-dir", ["data", "prepare", "{bad}/texts", "--out", "{bad}/texts/corpus"],
     "--out {bad}/texts/corpus.bin: lies inside {bad}/texts, which this command reads"),
    ("prepare-out-matches-input-glob", ["data", "prepare", "{bad}/texts/*", "--out", "{bad}/texts/corpus"],
     "--out {bad}/texts/corpus.bin: matches the input pattern {bad}/texts/*, which this command reads"),
    ("svg-over-user-file", ["plan", DEFAULT, "--svg", "{bad}/picture.svg"],
     "--svg {bad}/picture.svg: exists and is not a picture megashard plan drew"),
    # data is never silently changed
    ("prepare-latin1-strict", ["data", "prepare", "{bad}/latin1.txt", "--out", "{bad}/l1"],
     "{bad}/latin1.txt: byte 0xe9 at offset 3 (line 1) is not valid utf-8"),
    ("prepare-bad-encoding", ["data", "prepare", "{bad}/utf8.txt", "--out", "{bad}/x", "--encoding", "klingon"],
     "--encoding 'klingon': not an encoding Python knows"),
    ("prepare-utf16", ["data", "prepare", "{bad}/utf8.txt", "--out", "{bad}/x", "--encoding", "utf-16"],
     "--encoding utf-16: files are read line by line"),
    ("flat-float32", RUN + ["data.source=indexed", "data.path={bad}/f32.bin", "data.flat_dtype=float32"],
     "data.flat_dtype='float32' is not a token dtype; token ids are integers"),
    # the dry run checks what the real run will
    ("prepare-glob-nothing", ["run", TEXT, "--dry-run", "data.path={bad}/fresh/corpus",
                              "data.prepare_inputs=[{bad}/nowhere/*.txt]"],
     "data.prepare_inputs (data.path={bad}/fresh/corpus has no corpus yet, so megashard run would prepare it): "
     "{bad}/nowhere/*.txt: no input file matches this pattern"),
    ("prepare-tokenizer-unknown", ["run", TEXT, "--dry-run", "data.path={bad}/fresh/corpus",
                                   "data.prepare_tokenizer=gpt2"], "data.prepare_tokenizer='gpt2'"),
    ("prepare-input-latin1", ["run", TEXT, "--dry-run", "data.path={bad}/fresh/corpus",
                              "data.prepare_inputs=[{bad}/latin1.txt]"],
     "is not valid utf-8: the text would be changed; give the file's encoding (data.prepare_encoding=latin-1"),
    ("prepare-encoding-errors", RUN + ["data.prepare_encoding_errors=ignore"],
     "data.prepare_encoding_errors='ignore' is not supported"),
    ("timeout-tiny", RUN + ["parallel.timeout=0.01"], "timeout=0.01 seconds is too short to be real"),
    ("seed-too-big", ["plan", DEFAULT, "parallel.seed=18446744073709551616"], "seed=18446744073709551616 must be in 0..2**62"),
    # readers of the user's files
    ("hf-config-list", RUN + ["model.init_from={bad}/hf-list"], "config.json must hold a JSON object"),
    ("hf-config-string", RUN + ["model.init_from={bad}/hf-str"], 'n_embd must be an integer, got "64" (str)'),
    ("hf-config-missing", RUN + ["model.init_from={bad}/hf-missing"], "has no n_layer (an integer)"),
    ("hf-config-null", RUN + ["model.init_from={bad}/hf-null"], "has no n_layer (an integer)"),
    ("hf-config-bool", RUN + ["model.init_from={bad}/hf-bool"], "n_head must be an integer, got true (bool)"),
    ("hf-weight-map-list", RUN + ["model.init_from={bad}/hf-wm"], "weight_map must be a non-empty mapping"),
    ("hf-weight-map-outside", RUN + ["model.init_from={bad}/hf-wm-out"],
     "weight_map['transformer.wte.weight'] must be the name of a .safetensors file"),
    ("inspect-meta-no-tokenizer", ["data", "inspect", "{bad}/nt"], "{bad}/nt.meta.json: corpus metadata has no tokenizer"),
    ("inspect-meta-list", ["data", "inspect", "{bad}/ml"], "not megashard corpus metadata (needs a JSON object"),
    # the CLI's own misreadings
    ("tokenizer-dir", ["data", "prepare", "{bad}/utf8.txt", "--out", "{bad}/x", "--tokenizer", "{bad}/tok"],
     "{bad}/tok: is a directory, but a tokenizer is one Hugging Face tokenizer.json file"),
    ("run-override-first", ["run", "train.steps=2", DEFAULT], f"the config file comes first, then the overrides: "
     f"megashard run {DEFAULT} train.steps=2"),
    ("plan-override-first", ["plan", "train.steps=2", DEFAULT], "the config file comes first"),
]


@pytest.mark.parametrize("name,argv,expect", CLI, ids=[c[0] for c in CLI])
def test_bad_input_is_one_line_exit_2_and_nothing_of_the_user_changes(name, argv, expect, bad, capsys, no_launch):
    if "hf-" in name and not HAS_SAFETENSORS:
        pytest.skip("model.init_from needs the optional safetensors package")
    before = tree_snapshot(bad)
    argv = _fmt(argv, bad)
    cmd = " ".join(argv[:2]) if argv[0] in ("data", "ckpt") else argv[0]
    line = _one_line(capsys, main(argv), f"megashard {cmd}: error: ")
    assert expect.replace("{bad}", bad) in line, line
    after = tree_snapshot(bad)
    assert before == after, sorted(set(before.items()) ^ set(after.items()))[:6]


def test_the_cases_cover_every_kind():
    kinds = ("run-out", "prepare-over", "svg-over", "prepare-latin1", "flat-float32", "prepare-glob", "prepare-tokenizer",
             "timeout", "hf-config", "hf-weight-map", "inspect-meta", "tokenizer-dir", "run-override-first")
    assert all(any(c[0].startswith(k) for c in CLI) for k in kinds) and len({c[0] for c in CLI}) == len(CLI)


# ---------------------------------------------------------------------------------------------- data: read once, encoded
def _prepare(argv: list[str], cwd: str, capsys) -> tuple[int, str]:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        code = main(["data", "prepare", *argv, "-q"])
    finally:
        os.chdir(old)
    return code, capsys.readouterr().err


def test_a_symlink_loop_and_repeated_paths_are_read_once_and_named(tmp_path, capsys):
    """Before: `dir/**/*.txt` followed dir/sub/loop -> dir about 40 times, every document ~41 times, silently."""
    from megashard.data.indexed import IndexedDataset

    (tmp_path / "dir" / "sub").mkdir(parents=True)
    (tmp_path / "dir" / "a.txt").write_text("the first document\n")
    (tmp_path / "dir" / "sub" / "b.txt").write_text("the second document\n")
    os.symlink("..", tmp_path / "dir" / "sub" / "loop")
    os.symlink("../a.txt", tmp_path / "dir" / "sub" / "same.txt")
    code, err = _prepare(["dir/**/*.txt", "dir/a.txt", "--out", "c"], str(tmp_path), capsys)
    assert code == 0, err
    assert IndexedDataset(str(tmp_path / "c")).num_documents == 2
    note = [line for line in err.splitlines() if "note:" in line]
    assert len(note) == 1 and "read each file once" in note[0] and "symbolic link loop" in note[0], err
    assert "dir/sub/loop -> " in note[0] and "2 path(s) led to a file already taken" in note[0], note


def test_text_not_valid_in_its_encoding_is_refused_replaced_counted_skipped_or_decoded(bad, tmp_path, capsys):
    """Before: Latin-1 text became U+FFFD without a word. Now strict (default) refuses it, and each choice is counted."""
    from megashard.data.indexed import IndexedDataset

    latin, utf8 = os.path.join(bad, "latin1.txt"), os.path.join(bad, "utf8.txt")
    code, err = _prepare([latin, "--out", "r", "--encoding-errors", "replace"], str(tmp_path), capsys)
    assert code == 0 and "100 byte(s) not valid utf-8 in 1 file(s) written as U+FFFD" in err, err
    assert json.loads((tmp_path / "r.meta.json").read_text())["replaced_bytes"] == 100
    code, err = _prepare([latin, utf8, "--out", "s", "--encoding-errors", "skip-file"], str(tmp_path), capsys)
    assert code == 0 and f"1 file(s) left out for bytes not valid utf-8 (--encoding-errors skip-file), e.g. {latin}" in err
    assert IndexedDataset(str(tmp_path / "s")).num_documents == 1
    code, err = _prepare([latin, "--out", "d", "--encoding", "latin-1"], str(tmp_path), capsys)
    assert code == 0, err
    ids = IndexedDataset(str(tmp_path / "d")).read(0, IndexedDataset(str(tmp_path / "d")).num_tokens)
    text = bytes(int(i) for i in ids if int(i) < 256).decode("utf-8")  # the byte tokenizer: UTF-8 bytes + end token
    assert text == open(latin, encoding="latin-1").read()
    code, err = _prepare([latin, "--out", "all", "--encoding-errors", "skip-file"], str(tmp_path), capsys)
    assert code == 2 and "no text left to tokenize" in err and not (tmp_path / "all.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{p}{e}" for p in "rsd" for e in (".bin", ".idx", ".meta.json")), "no temporary file left behind"


def test_prepare_replaces_its_own_corpus_and_float_token_files_are_refused(tmp_path, capsys):
    from megashard.data.indexed import MAGIC, IndexedDataset
    from megashard.data.tokens import DTYPES, FlatTokens
    from megashard.errors import DataError
    from megashard.train.sections import FLAT_DTYPES

    (tmp_path / "t.txt").write_text("some text\n")
    for _ in range(2):  # the second run replaces the corpus the first one made
        code, err = _prepare(["t.txt", "--out", "c"], str(tmp_path), capsys)
        assert code == 0, err
    assert tuple(DTYPES) == FLAT_DTYPES and not any(d.is_floating_point for d in DTYPES.values())
    (tmp_path / "f.bin").write_bytes(bytes(16))
    with pytest.raises(DataError, match=r"token dtype='float32': token ids are integers"):
        FlatTokens(str(tmp_path / "f.bin"), "float32")
    idx = bytearray((tmp_path / "c.idx").read_bytes())  # Megatron's float32 dtype code (7) in the header
    assert idx.startswith(MAGIC)
    idx[len(MAGIC) + 8] = 7
    (tmp_path / "c.idx").write_bytes(bytes(idx))
    with pytest.raises(DataError, match=r"its tokens are float32 \(dtype code 7\), but token ids are integers"):
        IndexedDataset(str(tmp_path / "c"))


# ---------------------------------------------------------------------------------------------- markers
def test_owned_places_markers_and_what_older_megashard_left(tmp_path):
    from megashard import outputs
    from megashard.checkpoint import safety
    from megashard.train import ckptlock

    # the names the recognisers know are the ones megashard writes
    assert outputs._CKPT_ENTRY.match(safety.TMP_PREFIX + "step_00000001")
    assert outputs._CKPT_ENTRY.match(ckptlock.LOCK_NAME) and set(outputs._CKPT_FILES) >= {safety.MARKER_FILE,
                                                                                           safety.LAYOUT_FILE}
    old = tmp_path / "old-run"  # a run directory written before markers: resumed as before
    (old / "checkpoints" / "step_00000004").mkdir(parents=True)
    (old / "checkpoints" / "step_00000004" / "COMPLETE.json").write_text("{}")
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    (old / "config.yaml").write_text(outputs.RESOLVED_CONFIG_HEADER + "old (overrides applied)\n")
    assert outputs.owner(str(old), "run") == "recognised"
    # what a run of megashard without markers also left: the world record (elastic starts) and the doctor's records
    # of the first world and of a later one (a restart, a new elastic world)
    from megashard.train.world import WORLD_FILE

    (old / WORLD_FILE).write_text('{"run_id": "x"}')
    (old / "doctor" / "restart_1").mkdir(parents=True)
    (old / "doctor" / "rank_0.json").write_text("{}")
    (old / "doctor" / "restart_1" / "rank_3.json").write_text("{}")
    assert outputs.owner(str(old), "run") == "recognised"
    (old / "doctor" / "restart_1" / "my-notes.txt").write_text("mine\n")  # not a record: the directory is not ours
    assert outputs.owner(str(old), "run") == "foreign"
    (old / "doctor" / "restart_1" / "my-notes.txt").unlink()
    outputs.claim_dir(str(old), "run")
    assert outputs.marker_kinds(str(old)) == ["run"] and outputs.owner(str(old), "run") == "marked"
    (old / "notes.txt").write_text("mine\n")  # marked: its own entries only are written, a note of the user's stays
    assert outputs.owner(str(old), "run") == "marked"
    mixed = tmp_path / "mixed"  # the same evidence next to a file of the user's: not megashard's
    shutil.copytree(old / "checkpoints", mixed / "checkpoints")
    (mixed / "thesis.tex").write_text("mine\n")
    assert outputs.owner(str(mixed), "run") == "foreign"
    with pytest.raises(ConfigError, match=r"holds checkpoints, thesis.tex, not made by megashard"):
        outputs.claim_dir(str(mixed), "run", "train.out_dir=")


def test_a_checkpoint_root_keeps_entries_that_are_not_megashards(tmp_path):
    """Before: a save removed every `.tmp-*` of the root (a `.tmp-notes` of the user's too), and overwrite=True
    deleted whatever directory had a checkpoint's name."""
    from megashard.checkpoint import safety

    root = tmp_path / "root"  # a checkpoint root: a user's .tmp-notes is not a leftover of a save
    (root / ".tmp-notes").mkdir(parents=True)
    (root / ".tmp-step_00000003").mkdir()
    (root / ".trash-step_00000001-12-34").mkdir()
    assert sorted(os.path.basename(p) for p in safety.cleanup_stale(str(root))) == [
        ".tmp-step_00000003", ".trash-step_00000001-12-34"]
    assert (root / ".tmp-notes").is_dir()
    (root / "step_00000005").mkdir()  # not a checkpoint (no marker, no layout file): overwrite=True keeps it
    (tmp_path / "new").mkdir()
    with pytest.raises(MegashardError, match=r"is not a checkpoint megashard saved"):
        safety.commit_checkpoint(str(tmp_path / "new"), str(root / "step_00000005"), overwrite=True)


# ---------------------------------------------------------------------------------------------- Python API
def test_the_python_api_checks_what_the_cli_checks(tmp_path):
    import megashard
    from megashard import checkpoint
    from megashard.config import ParallelConfig
    from megashard.errors import NotADTensorError, RNGTrackerError, StateError
    from megashard.state.rng_tracker import CudaRNGStatesTracker
    from megashard.tensors.uneven import gather_uneven_dtensor_to_full_tensor, split_dtensor, validate_uneven_dtensor

    with pytest.raises(StateError, match=r"set_parallel_state\('tp'\): expects a ParallelState .* got str"):
        megashard.set_parallel_state("tp")
    for seed, name in ((2**64, "a"), (-(2**63) - 1, "b")):
        with pytest.raises(RNGTrackerError, match=rf"RNG stream '{name}': seed {seed} is outside the range a torch "
                           r"generator takes, -2\*\*63..2\*\*64-1"):
            CudaRNGStatesTracker().add(name, seed)
    with pytest.raises(ConfigError, match=r"seed=4611686018427387905 must be in 0..2\*\*62"):
        ParallelConfig(seed=2**62 + 1)
    with pytest.raises(ConfigError, match=r"timeout=0.5 seconds is too short to be real"):
        ParallelConfig(timeout=0.5)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(MegashardError, match=r"model= expects a torch.nn.Module, got OrderedDict: pass the module"):
        checkpoint.save(str(tmp_path / "ck"), 1, model.state_dict())
    with pytest.raises(MegashardError, match=r"optimizer= expects a torch.optim.Optimizer .* got dict"):
        checkpoint.save(str(tmp_path / "ck"), 1, model, {"lr": 1})
    assert not (tmp_path / "ck").exists()
    for fn, args in ((split_dtensor, (torch.ones(4), 2)), (validate_uneven_dtensor, (torch.ones(4),)),
                     (gather_uneven_dtensor_to_full_tensor, (torch.ones(4),))):
        with pytest.raises(NotADTensorError, match=rf"{fn.__name__}\(dtensor=...\): expects a DTensor .* got Tensor: "
                           "a plain tensor has no device mesh"):
            list(fn(*args)) if fn is split_dtensor else fn(*args)
        assert issubclass(NotADTensorError, TypeError)  # Megatron-FSDP raises TypeError


def test_plan_of_a_parallel_only_file_plans_the_layout(tmp_path, capsys):
    cfg = tmp_path / "layout.yaml"
    cfg.write_text("parallel:\n  tp: 2\n  pp: 4\n")
    """Before: refused, as the default model's 2 layers cannot fill 4 stages (a model nobody set)."""
    assert main(["plan", str(cfg), "--world-size", "64"]) == 0
    out, err = capsys.readouterr()
    sizes = dict(line.split() for line in out.split("resolved sizes")[1].strip().splitlines()[:7])
    assert (sizes["tp"], sizes["pp"], sizes["world_size"]) == ("2", "4", "64") and err == "", err
    # a model section (in the file or an override) is checked against the stages, as `run` would
    assert main(["plan", str(cfg), "--world-size", "64", "model.layers=2"]) == 2
    assert "model.layers=2 cannot fill pp × vpp = 4 × 1 = 4" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- a real job's outputs
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A run directory: the default job, 2 ranks (tp=1), 2 steps, checkpoints of steps 1 and 2."""
    d = tmp_path_factory.mktemp("trust3-run")
    p = subprocess.run([sys.executable, "-m", "megashard", "run", DEFAULT, "train.steps=2", "launch.nproc_per_node=2",
                        "parallel.tp=1", "checkpoint.interval=1", f"train.out_dir={d}/run", "train.plot=false",
                        "train.progress=false", "launch.max_restarts=0"], capture_output=True, text=True, env=_env(),
                       timeout=600, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr[-3000:]
    return str(d / "run")


def test_a_run_directory_is_marked_and_an_older_one_resumes(trained, tmp_path, capsys):
    from megashard import outputs

    assert outputs.marker_kinds(trained) == ["run"]
    ckpt = os.path.join(trained, "checkpoints")  # recognised by its own entries (no marker among the steps)
    assert sorted(os.listdir(ckpt)) == ["step_00000001", "step_00000002"] and outputs.owner(ckpt, "checkpoints") == \
        "recognised"
    old = tmp_path / "old"
    shutil.copytree(trained, old)
    (old / outputs.MARKER).unlink()
    assert outputs.owner(str(old), "run") == "recognised"
    code = main(["run", DEFAULT, "--dry-run", f"train.out_dir={old}", "train.steps=3", "launch.nproc_per_node=2",
                 "parallel.tp=1"])
    assert code == 0, capsys.readouterr().err
    assert not (old / outputs.MARKER).exists()  # a dry run writes nothing


@pytest.mark.skipif(not HAS_SAFETENSORS, reason="export-hf needs the optional safetensors package")
def test_export_hf_force_replaces_only_its_own_export(trained, bad, tmp_path, capsys):
    """Before: `cd ~ && megashard ckpt export-hf runs/x/checkpoints . --force` replaced the whole directory."""
    home = os.path.join(bad, "home")
    before = tree_snapshot(home)
    old = os.getcwd()
    os.chdir(home)
    try:
        code = main(["ckpt", "export-hf", os.path.join(trained, "checkpoints"), ".", "--force"])
    finally:
        os.chdir(old)
    line = _one_line(capsys, code, "megashard ckpt export-hf: error: ")
    assert "OUT .: the existing directory holds notes.txt, thesis, not made by megashard; megashard replaces only a " \
           "directory it made itself" in line and "--force" not in line.split("megashard replaces")[0]
    assert tree_snapshot(home) == before
    out = str(tmp_path / "hf")
    assert main(["ckpt", "export-hf", os.path.join(trained, "checkpoints"), out]) == 0
    assert "exists and is not an empty directory (an earlier export of megashard); pass --force" in (
        main(["ckpt", "export-hf", os.path.join(trained, "checkpoints"), out]) == 2 and capsys.readouterr().err)
    os.remove(os.path.join(out, ".megashard-dir.json"))  # an export of an older megashard: recognised by its files
    assert main(["ckpt", "export-hf", os.path.join(trained, "checkpoints"), out, "--force"]) == 0
    assert os.path.isfile(os.path.join(out, ".megashard-dir.json"))
    assert not [n for n in os.listdir(tmp_path) if n != "hf"], os.listdir(tmp_path)  # no temporary left
    # An output inside the checkpoint directory given (before: written there, and the next `megashard run` found a
    # directory of foreign entries where its checkpoints are and refused to resume); consolidate alike.
    ck = os.path.join(trained, "checkpoints")
    entries = sorted(os.listdir(ck))
    capsys.readouterr()
    line = _one_line(capsys, main(["ckpt", "export-hf", ck, os.path.join(ck, "hf")]), "megashard ckpt export-hf: error: ")
    assert f"OUT {ck}/hf: lies inside {ck}, which this command reads" in line
    line = _one_line(capsys, main(["ckpt", "consolidate", ck, os.path.join(ck, "full.pt"), "-q"]),
                     "megashard ckpt consolidate: error: ")
    assert f"OUT {ck}/full.pt: lies inside {ck}, which this command reads" in line
    assert sorted(os.listdir(ck)) == entries


def test_consolidate_replaces_only_a_torch_file_and_only_with_force(trained, bad, capsys):
    """Before: `megashard ckpt consolidate CKPT notes.txt` overwrote the notes."""
    ck = os.path.join(trained, "checkpoints")
    notes = os.path.join(bad, "home", "notes.txt")
    code = main(["ckpt", "consolidate", ck, notes, "-q"])
    assert open(notes).read() == "my notes\n", "the user's notes were overwritten"
    line = _one_line(capsys, code, "megashard ckpt consolidate: error: ")
    assert "exists and is not a torch.save file" in line
    line = _one_line(capsys, main(["ckpt", "consolidate", ck, notes, "-q", "--force"]), "megashard ckpt consolidate: error: ")
    assert "exists and is not a torch.save file" in line and open(notes).read() == "my notes\n"
    out = os.path.join(os.path.dirname(bad), "full.pt")
    for _ in range(2):  # its own output (marked in the zip comment) is replaced by a rerun
        assert main(["ckpt", "consolidate", ck, out, "-q"]) == 0
    assert set(torch.load(out, weights_only=True)) >= {"model"}
    theirs = os.path.join(os.path.dirname(bad), "theirs.pt")
    torch.save({"w": torch.ones(3)}, theirs)  # a torch.save file of the user's: only with --force
    capsys.readouterr()
    line = _one_line(capsys, main(["ckpt", "consolidate", ck, theirs, "-q"]), "megashard ckpt consolidate: error: ")
    assert "is a torch.save file megashard did not write; pass --force to replace it" in line
    assert torch.equal(torch.load(theirs, weights_only=True)["w"], torch.ones(3))
    assert main(["ckpt", "consolidate", ck, theirs, "-q", "--force"]) == 0
    assert set(torch.load(theirs, weights_only=True)) >= {"model"}


def test_the_config_file_is_never_overwritten_by_a_run(bad, capsys, no_launch):
    """Before: `cd cfgdir && megashard run config.yaml train.out_dir=.` wrote the resolved config over config.yaml (and
    the next run read it back, overrides baked in)."""
    cfg = os.path.join(bad, "cfg")
    text = open(os.path.join(cfg, "config.yaml")).read()
    old = os.getcwd()
    os.chdir(cfg)
    try:
        code = main(["run", "config.yaml", "train.out_dir=.", "train.steps=2"])
    except AssertionError:  # no_launch: the job would have started (after writing its config)
        code = None
    finally:
        os.chdir(old)
    assert open(os.path.join(cfg, "config.yaml")).read() == text, "the user's config.yaml was overwritten"
    line = _one_line(capsys, code, "megashard run: error: ")
    assert "train.out_dir='.': megashard run writes the run's resolved config to ./config.yaml, which is the config " \
           "file config.yaml this command reads" in line
    assert open(os.path.join(cfg, "config.yaml")).read() == text and os.listdir(cfg) == ["config.yaml"]


def test_a_damaged_checkpoint_is_one_error_line_per_job(trained, tmp_path):
    """Before: every rank printed the same error (4 lines for 4 ranks)."""
    from tests._helpers import flip_bit

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    step = run / "checkpoints" / "step_00000002"
    data = sorted(f for f in os.listdir(step) if f.endswith(".distcp"))
    for f in data:
        flip_bit(str(step / f), 100, 2)  # every rank reads a damaged item
    p = subprocess.run([sys.executable, "-m", "megashard", "run", DEFAULT, "train.steps=3", "launch.nproc_per_node=2",
                        "parallel.tp=1", f"train.out_dir={run}", "checkpoint.load_step=2", "train.plot=false",
                        "train.progress=false", "launch.max_restarts=0"], capture_output=True, text=True, env=_env(),
                       timeout=600, stdin=subprocess.DEVNULL)
    errors = [line for line in p.stderr.splitlines() if ": error: " in line]
    assert p.returncode == 2, p.stderr[-3000:]
    assert len(errors) == 1 and "is damaged" in errors[0] and "Traceback" not in p.stderr, p.stderr[-3000:]
