"""`scaleopt data prepare` on bad input: records that can be skipped (counted, reported, capped)
and inputs that are refused with a message naming what is wrong."""

import json

import pytest

from scaleopt import cli

pytest.importorskip("tokenizers")


def _prepare(*args):
  return cli.main(["data", "prepare", "--quiet", *args])


def _jsonl(path, docs, bad):
  """``docs`` good records with the lines of ``bad`` (line number -> text) put in."""
  lines = [json.dumps({"text": d}) for d in docs]
  for n in sorted(bad):
    lines.insert(n - 1, bad[n])
  path.write_text("\n".join(lines) + "\n")


DOCS = [f"document {i} " + "word " * (i % 7 + 3) for i in range(200)]


@pytest.mark.parametrize("line,needle", [
    ('{"text": "a', "line 5 is not JSON"),
    ('{"text": null}', "line 5: field 'text' is null"),
])
def test_a_bad_record_stops_with_a_message_that_names_the_skip_flag(tmp_path, capsys, line,
                                                                     needle):
  inp = tmp_path / "d.jsonl"
  _jsonl(inp, DOCS, {5: line})
  assert _prepare("--input", str(inp), "--out", str(tmp_path / "o")) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and needle in err and "--skip-bad-records" in err, err
  assert "--text-field" not in err  # the field is there; its value is what is wrong
  assert not (tmp_path / "o").exists()


def test_skip_bad_records_counts_and_reports_them(tmp_path, capsys):
  inp = tmp_path / "d.jsonl"
  _jsonl(inp, DOCS, {3: '{"text": null}', 10: "not json", 50: '{"text": 7}', 60: "[1, 2]"})
  out = tmp_path / "o"
  assert _prepare("--input", str(inp), "--out", str(out), "--skip-bad-records") == 0
  said = capsys.readouterr().out
  assert "skipped 4 bad records" in said, said
  man = json.loads((out / "manifest.json").read_text())
  assert man["skipped"]["bad records"] == 4
  # exactly the good documents were written: the same shards as an input without the bad lines
  clean = tmp_path / "clean.jsonl"
  _jsonl(clean, DOCS, {})
  assert _prepare("--input", str(clean), "--out", str(tmp_path / "c")) == 0
  ref = json.loads((tmp_path / "c" / "manifest.json").read_text())
  assert man["content_hash"] == ref["content_hash"]


def test_more_bad_records_than_the_cap_stop_the_run(tmp_path, capsys):
  inp = tmp_path / "d.jsonl"
  _jsonl(inp, DOCS, {n: "oops" for n in (2, 4, 6, 8)})
  out = tmp_path / "o"
  assert _prepare("--input", str(inp), "--out", str(out), "--skip-bad-records",
                  "--max-bad-records", "3") == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "more than 3 bad records" in err and "line 8" in err, err
  assert _prepare("--input", str(inp), "--out", str(out), "--skip-bad-records",
                  "--max-bad-records", "4") == 0


def test_max_bad_records_without_skipping_is_refused(tmp_path, capsys):
  inp = tmp_path / "d.jsonl"
  _jsonl(inp, DOCS, {})
  assert _prepare("--input", str(inp), "--out", str(tmp_path / "o"), "--max-bad-records",
                  "3") == 2
  assert "--skip-bad-records" in capsys.readouterr().err


def test_inputs_are_refused_with_what_is_wrong(tmp_path, capsys):
  empty = tmp_path / "empty.txt"
  empty.write_bytes(b"")
  binary = tmp_path / "blob.bin"
  binary.write_bytes(bytes(range(256)) * 10)
  folder = tmp_path / "folder"
  folder.mkdir()
  (folder / "a.txt").write_text("some text\n" * 50)
  cases = [
      (["--input", str(empty)], "is empty", "val-fraction"),
      (["--input", str(binary)], "not text", "val-fraction"),
      (["--input", "https://example.com/corpus.jsonl"], "URL", "does not exist"),
      (["--input", str(folder), "--out", str(folder)], "--out", None),
      (["--input", str(folder), "--out", str(folder / "shards")], "inside", None),
  ]
  for args, needle, wrong in cases:
    if "--out" not in args:
      args = args + ["--out", str(tmp_path / "o")]
    assert _prepare(*args) == 2, args
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, (args, err)
    if wrong:
      assert wrong not in err, (args, err)
  assert sorted(p.name for p in folder.iterdir()) == ["a.txt"]
  assert not (tmp_path / "o").exists()


def test_help_names_the_skip_flags(capsys):
  with pytest.raises(SystemExit):
    cli.main(["data", "prepare", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert "--skip-bad-records" in text and "--max-bad-records" in text


def test_a_null_in_a_parquet_column_is_a_bad_record_too(tmp_path, capsys):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  inp = tmp_path / "d.parquet"
  pq.write_table(pa.table({"text": DOCS[:20] + [None] + DOCS[20:]}), inp)
  assert _prepare("--input", str(inp), "--out", str(tmp_path / "o")) == 2
  err = capsys.readouterr().err
  assert "row 20: field 'text' is null" in err and "--skip-bad-records" in err, err
  assert _prepare("--input", str(inp), "--out", str(tmp_path / "o"), "--skip-bad-records") == 0
  assert "skipped 1 bad records" in capsys.readouterr().out
