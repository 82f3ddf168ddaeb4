"""The README's speed and time-to-accuracy tables are the rendering of the results files the benchmarks
write (scripts/readme_tables.py), so they cannot drift from what was measured; a results file the renderer
cannot read is refused with one line naming the file, the row and the field."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import readme_tables as rt  # noqa: E402


def test_the_readmes_tables_are_the_rendering_of_the_results_files():
    text = (ROOT / "README.md").read_text()
    for name in rt.TABLES:
        begin, end = rt.markers(name)
        inside = text[text.index(begin) + len(begin):text.index(end)].strip("\n")
        assert inside == rt.rendered(name), f"README.md's {name} table is not its results file's rendering: " \
                                            f"run python3 scripts/readme_tables.py"
    assert rt.main(["--check"]) == 0


def test_each_table_names_its_date_and_gpu_and_stands_beside_pytorch():
    speed, tta = rt.rendered("speed"), rt.rendered("time_to_accuracy")
    for table in (speed, tta):
        assert table.startswith("Measured 20") and " on NVIDIA " in table.splitlines()[0]
    assert "PyTorch's fastest float32 form" in speed and "| 65536 |" in speed
    assert "| PyTorch, CUDA graph |" in tta and "| ours |" in tta


def test_check_fails_where_the_readme_differs(tmp_path, capsys):
    text = (ROOT / "README.md").read_text()
    readme = tmp_path / "README.md"
    begin, _ = rt.markers("speed")
    readme.write_text(text.replace(begin + "\n", begin + "\n| 1 | 1.0 | edited by hand |\n", 1))
    assert rt.main(["--check", "--readme", str(readme)]) == 1
    assert "speed table" in capsys.readouterr().err
    assert rt.main(["--readme", str(readme)]) == 0   # rewritten from the results files
    assert readme.read_text() == text
    readme.write_text(text.replace(begin, "", 1))    # a table's marker gone: refused, not guessed
    assert rt.main(["--check", "--readme", str(readme)]) == 2
    assert "markers" in capsys.readouterr().err


def _speed_row(**kw):
    row = {"batch": 64, "ours_us": 30.0, "torch_form": "torch graph bench fused", "torch_us": 200.0,
           "measured": "2026-12-01", "gpu": "NVIDIA H100 80GB HBM3", "cudnn": "9.19.0", "commit": "abc1234",
           "command": "python3 scripts/bench.py --batch 64"}
    return {**row, **kw}


@pytest.mark.parametrize("change, says", [
    (lambda d: d.pop("rows"), "'rows' must be a non-empty list"),
    (lambda d: d.update(kind="time_to_accuracy"), "'kind' must be 'speed'"),
    (lambda d: d["rows"][0].pop("gpu"), "row 1: missing 'gpu'"),
    (lambda d: d["rows"][0].update(ours_us="fast"), "row 1: 'ours_us' must be a positive number"),
    (lambda d: d["rows"][0].update(torch_us=float("nan")), "row 1: 'torch_us' must be a positive number"),
    (lambda d: d["rows"][0].update(batch=0), "row 1: 'batch' must be a positive integer"),
    (lambda d: d["rows"][0].update(measured="yesterday"), "row 1: 'measured' must be a date"),
    (lambda d: d["rows"][0].update(us=3), "row 1: unknown field 'us'"),
    (lambda d: d["rows"].append(copy.deepcopy(d["rows"][0])), "row 2: a second row for (64,)"),
])
def test_a_malformed_speed_file_is_refused_in_one_line(tmp_path, change, says):
    d = {"kind": "speed", "rows": [_speed_row()]}
    change(d)
    path = tmp_path / "speed.json"
    path.write_text(json.dumps(d))
    with pytest.raises(rt.ResultsError) as e:
        rt.load(path, "speed")
    assert says in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_malformed_time_to_accuracy_file_and_a_file_that_is_not_json_are_refused(tmp_path):
    good = json.loads(rt.TIME_TO_ACCURACY.read_text())
    bad = copy.deepcopy(good)
    bad["rows"][0]["wall_s"] = bad["rows"][0]["wall_s"][:-1]
    path = tmp_path / "tta.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(rt.ResultsError, match="one length"):
        rt.load(path, "time_to_accuracy")
    bad = copy.deepcopy(good)
    bad["rows"][0]["accuracy"][0] = 150
    path.write_text(json.dumps(bad))
    with pytest.raises(rt.ResultsError, match="percentages"):
        rt.load(path, "time_to_accuracy")
    path.write_text("{not json")
    with pytest.raises(rt.ResultsError, match="not JSON"):
        rt.load(path, "time_to_accuracy")
    with pytest.raises(rt.ResultsError, match="cannot be read"):
        rt.load(tmp_path / "missing.json", "speed")


def test_record_replaces_the_rows_it_measured_and_keeps_the_others(tmp_path):
    path = tmp_path / "results" / "speed.json"
    rt.record(path, "speed", [_speed_row(batch=1, ours_us=20.0), _speed_row(batch=64)])
    rt.record(path, "speed", [_speed_row(batch=64, ours_us=25.0, measured="2026-12-02")])
    rows = {r["batch"]: r for r in rt.load(path, "speed")["rows"]}
    assert rows[1]["ours_us"] == 20.0 and rows[64]["ours_us"] == 25.0 and rows[64]["measured"] == "2026-12-02"
    table = rt.render_speed(rt.load(path, "speed"))
    assert "Measured 2026-12-01 to 2026-12-02 on NVIDIA H100 80GB HBM3" in table
    assert "| 64 | 25.0 | 2.56 | torch graph bench fused | 200.0 | 8.00x |" in table
    before = path.read_text()
    with pytest.raises(rt.ResultsError, match="'ours_us' must be a positive number"):
        rt.record(path, "speed", [_speed_row(batch=128, ours_us=-1)])
    assert path.read_text() == before   # nothing written


def test_provenance_names_the_date_and_the_commit():
    p = rt.provenance("python3 scripts/bench.py")
    assert p["command"] == "python3 scripts/bench.py" and len(p["measured"]) == 10 and p["commit"]


def test_provenance_says_with_changes_for_code_not_for_recorded_results(tmp_path, monkeypatch):
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("no git")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "speed.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "c"]):
        subprocess.run(["git", *cmd], cwd=tmp_path, check=True, env={**__import__("os").environ, **env})
    monkeypatch.setattr(rt, "ROOT", tmp_path)
    assert not rt.provenance("c")["commit"].endswith("with changes")
    (tmp_path / "docs" / "results" / "speed.json").write_text('{"rows": []}')   # an earlier --record's rows
    assert not rt.provenance("c")["commit"].endswith("with changes")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert rt.provenance("c")["commit"].endswith(" with changes")


def test_the_benchmarks_record_the_rows_the_renderer_reads(tmp_path):
    pytest.importorskip("torch")
    import bench
    import time_to_accuracy as tta

    summary = {"fastest_torch_fp32": "torch graph bench fused", "torch_us": 200.0}
    out = {"gpu": "NVIDIA H100 80GB HBM3", "cudnn": "9.19.0",
           "results": {"64": {"ours auto": {"us_per_step": 30.0}, "summary": summary},
                       "1": {"ours legacy": {"us_per_step": 70.0}, "summary": summary},   # no ours auto: left out
                       "epoch": {"ours_s": 0.1}}}
    rows = bench.record_rows(out, "python3 scripts/bench.py --batch 64")
    assert [r["batch"] for r in rows] == [64] and rows[0]["torch_us"] == 200.0
    rt.record(tmp_path / "speed.json", "speed", rows)
    assert "| 64 | 30.0 |" in rt.render_speed(rt.load(tmp_path / "speed.json", "speed"))
    assert bench.parser().parse_args(["--record", "x.json"]).record == "x.json"

    table_rows = [{"recipe": "fast", "flags": "--epochs 16", "who": "torch", "accuracy": [91.2, None],
                   "wall_s": [7.4, 7.5], "mean_accuracy": 91.2, "breakdown": []}]
    rows = tta.record_rows(table_rows, tta.run_kind(False, True), {"gpu": "NVIDIA H100 80GB HBM3", "cudnn": "9.19.0"},
                           "python3 scripts/time_to_accuracy.py --torch", [0, 1])
    rt.record(tmp_path / "tta.json", "time_to_accuracy", rows)
    table = rt.render_time_to_accuracy(rt.load(tmp_path / "tta.json", "time_to_accuracy"))
    assert "| fast | PyTorch, CUDA graph | later (caches warm) | 91.20 / failed | 91.20 | 7.40 / 7.50 | 7.45 |" in table
    with pytest.raises(SystemExit, match="--validation runs are not recorded"):
        tta.main(["--record", str(tmp_path / "tta.json"), "--validation", "100"])
