"""`megashard data prepare` end to end: text + JSON lines in, an indexed dataset out that reads back as the
tokenization, the same with 1 or 2 worker processes and with inputs cut into pieces; a trained BPE tokenizer
(when Hugging Face `tokenizers` is installed); one-line errors (exit 2) for every bad input."""
from __future__ import annotations

import filecmp
import json
import os

import pytest

from megashard import cli
from megashard.data.indexed import IndexedDataset

TEXT = "Über café — a first document.\n\nIt has two paragraphs.\n"
TEXT2 = "def f(x):\n    return x * 2\n" * 40
JSONL = [{"text": "jsonl doc one", "id": 1}, {"text": ""}, {"text": "third ✓ doc\nwith a newline"}]


@pytest.fixture()
def inputs(tmp_path):
    a, b, c = tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "code.py"
    a.write_text(TEXT, encoding="utf-8")
    b.write_text("\n".join(json.dumps(o, ensure_ascii=False) for o in JSONL) + "\n\n", encoding="utf-8")
    c.write_text(TEXT2, encoding="utf-8")
    (tmp_path / "out").mkdir()
    return [str(a), str(b), str(c)]


DOCS = [TEXT] + [o["text"] for o in JSONL] + [TEXT2]


def _prepare(*args: str) -> int:
    return cli.main(["data", "prepare", *args, "--quiet"])


def _docs(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    ds.verify()
    return [ds.document(i).tolist() for i in range(ds.num_documents)]


def test_byte_tokenizer_end_to_end(inputs, tmp_path, capsys):
    out = str(tmp_path / "out" / "corpus")
    assert _prepare(*inputs, "--tokenizer", "byte", "--out", out) == 0
    assert "wrote" in capsys.readouterr().err
    assert _docs(out) == [list(t.encode("utf-8")) + [256] for t in DOCS]
    meta = json.load(open(out + ".meta.json"))
    assert (meta["tokenizer"], meta["vocab_size"], meta["eod_id"], meta["dtype"]) == ("byte", 257, 256, "uint16")
    assert meta["documents"] == 5 and meta["tokens"] == sum(len(t.encode()) + 1 for t in DOCS)
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx", "corpus.meta.json"]  # no temporaries


def test_workers_and_pieces_do_not_change_the_output(inputs, tmp_path, monkeypatch):
    import megashard.data.prepare as prep

    one, two = str(tmp_path / "out" / "one"), str(tmp_path / "out" / "two")
    assert _prepare(*inputs, "--out", one) == 0
    monkeypatch.setattr(prep, "PIECE", 16)  # JSON lines cut into many tasks, at line ends
    monkeypatch.setattr(prep, "CHUNK", 7)   # text read 7 bytes at a time, cut at line ends
    assert _prepare(*inputs, "--out", two, "--workers", "2") == 0  # real worker processes
    assert filecmp.cmp(one + ".bin", two + ".bin", shallow=False)
    assert filecmp.cmp(one + ".idx", two + ".idx", shallow=False)


def test_directory_and_glob_inputs(inputs, tmp_path):
    out = str(tmp_path / "out" / "g")
    assert _prepare(str(tmp_path / "*.txt"), str(tmp_path / "code.py"), "--out", out) == 0
    assert _docs(out) == [list(TEXT.encode()) + [256], list(TEXT2.encode()) + [256]]


def test_trained_bpe_tokenizer(inputs, tmp_path):
    pytest.importorskip("tokenizers", reason="Hugging Face tokenizers is not installed (pip install 'megashard[data]')")
    from megashard.data.tokenizer import HFTokenizer

    out = str(tmp_path / "out" / "bpe")
    assert _prepare(*inputs, "--train-tokenizer", "300", "--out", out) == 0
    tok = HFTokenizer(out + ".tokenizer.json")
    assert tok.vocab_size == 300 and tok.eod_id == 0
    meta = json.load(open(out + ".meta.json"))
    assert (meta["tokenizer"], meta["vocab_size"], meta["eod_id"]) == ("bpe.tokenizer.json", 300, 0)
    docs = _docs(out)
    assert docs == [tok.encode(t) + [0] for t in DOCS]
    assert len(docs[-1]) < len(TEXT2.encode()) // 2  # it learned merges
    assert tok.decode(docs[0][:-1]) == TEXT
    # the saved tokenizer.json works as --tokenizer for another corpus; a document too large to be tokenized
    # whole is cut at line ends between non-space characters, with the same result
    import megashard.data.prepare as prep

    again = str(tmp_path / "out" / "again")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prep, "WHOLE", 100)
        mp.setattr(prep, "CHUNK", 40)
        assert _prepare(inputs[2], inputs[0], "--tokenizer", out + ".tokenizer.json", "--out", again) == 0
    assert _docs(again) == [docs[-1], docs[0]]


def test_missing_tokenizers_package_says_what_to_install(inputs, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    assert _prepare(inputs[0], "--train-tokenizer", "300", "--out", str(tmp_path / "out" / "x")) == 2
    err = capsys.readouterr().err
    assert "needs the Hugging Face 'tokenizers' package" in err and "pip install 'megashard[data]'" in err
    assert os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("args, message", [
    (["{tmp}/nothere.txt", "--out", "{tmp}/out/c"], r"{tmp}/nothere.txt: no such input file"),
    (["{tmp}/*.md", "--out", "{tmp}/out/c"], r"{tmp}/\*.md: no input file matches this pattern"),
    (["{tmp}/a.txt", "--tokenizer", "{tmp}/tok.json", "--out", "{tmp}/out/c"], r"{tmp}/tok.json: tokenizer file does not exist"),
    (["{tmp}/a.txt", "--tokenizer", "gpt2", "--out", "{tmp}/out/c"], r"unknown tokenizer 'gpt2': use 'byte'"),
    (["{tmp}/a.txt", "--out", "{tmp}/nodir/c"], r"output directory '{tmp}/nodir' does not exist"),
    (["{tmp}/a.txt", "--out", "{tmp}/out/c", "--workers", "0"], r"--workers 0 must be a positive integer"),
    (["{tmp}/a.txt", "{tmp}/b.jsonl", "--out", "{tmp}/out/c", "--text-key", "body"],
     r"{tmp}/b.jsonl: the line at byte 0 has no string field 'body'"),
])
def test_bad_input_is_one_line_exit_2(inputs, tmp_path, capsys, args, message):
    import re

    tmp = str(tmp_path)
    assert _prepare(*[a.replace("{tmp}", tmp) for a in args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("megashard data prepare: error: "), err
    assert re.search(message.replace("{tmp}", re.escape(tmp)), err), err
    assert os.listdir(tmp_path / "out") == []  # nothing written, nothing left behind


def test_not_json_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    assert _prepare(str(bad), "--out", str(tmp_path / "c")) == 2
    assert f"{bad}: the line at byte 15 is not JSON" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_not_a_terminal_no_progress_lines_and_the_summary_names_both_files(inputs, tmp_path):
    """stderr to a log (a pipe): a short job prints no progress lines, only the summary naming both files."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "out" / "docs")
    p = subprocess.run([sys.executable, "-m", "megashard", "data", "prepare", *inputs, "--out", out],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root}, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and p.stdout == "", p.stderr
    assert lines[0].startswith(f"megashard data prepare: wrote {out}.bin and {out}.idx: 5 documents, "), lines[0]
    assert "[" not in lines[0] and "%" not in lines[0]


def test_progress_off_a_terminal_prints_every_few_seconds_only():
    import io

    from megashard.progress import Progress

    log = io.StringIO()
    bar = Progress(100, "prepare", stream=log)  # default: a line every 10 s; this job takes no time
    for _ in range(10):
        bar.update(10)
    bar.close()
    assert log.getvalue() == ""
    log = io.StringIO()
    bar = Progress(100, "prepare", stream=log, log_seconds=0.0)  # a long job: lines as time passes, and the end
    bar.update(50)
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "50.0%" in lines[0] and "100.0%" in lines[1] and "\r" not in log.getvalue()


def test_named_empty_or_binary_inputs_are_refused_found_ones_left_out(inputs, tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blob.bin").write_bytes(b"\x7fELF\x00\x01")
    for bad, why in (("empty.txt", "is empty (0 bytes)"), ("blob.bin", "is binary, not text (a NUL byte at offset 4)")):
        assert _prepare(inputs[0], str(tmp_path / bad), "--out", str(tmp_path / "out" / "c")) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{tmp_path / bad} {why}" in err, err
        assert os.listdir(tmp_path / "out") == []
    # found in a directory: left out with a note, the text files tokenized
    os.makedirs(str(tmp_path) + "-out", exist_ok=True)
    out = str(tmp_path) + "-out/dir"  # outside the directory it reads
    assert _prepare(str(tmp_path), "--out", out) == 0
    assert "note: left out 2 empty or binary file(s) found in the inputs" in capsys.readouterr().err
    assert json.load(open(out + ".meta.json"))["documents"] == 5
