"""`spec-parity combine`: the table it prints is the runs' own figures (checked against the JSON
the bench wrote), a ratio that moves more than its spread becomes a range (a shift planted in one
run's data turns a single value into one), and runs that cannot make one figure are refused in one
line. docs/benchmarks.md's tables are held to the run files in benchmarks/ they name."""

from __future__ import annotations

import copy
import json
import re
import statistics
from pathlib import Path

import pytest

from spec_parity import cli
from spec_parity.bench import combine

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "benchmarks"
PAGE = ROOT / "docs" / "benchmarks.md"
PEERS = {src: [RUNS / f"serve-{src}-h200-peers-{i}.json" for i in (1, 2)] for src in ("dflash", "dspark")}
BENCH = [RUNS / f"step-assistant-h100-{i}.json" for i in (1, 2)]


def _load(paths):
    return [json.loads(p.read_text()) for p in paths]


def _cell(d: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    if d is None:
        return "–"
    return f"{d['median'] * scale:.{digits}f} [{d['p10'] * scale:.{digits}f}–{d['p90'] * scale:.{digits}f}]"


def _side(doc: dict, key, case: str, side: str) -> dict | None:
    c = next((c for c in doc["cases"] if key(c) == case), None)
    return next((s for s in c["sides"] if s["side"] == side and s["status"] == "ok"), None) if c else None


def _serve_key(c):
    return f"{c['condition']}: {c['case']}"


def _rows(markdown: str, case: str) -> dict[str, list[str]]:
    """The table rows under one case's heading, by side."""
    block = markdown.split(f"## {case}\n", 1)[1].split("\n## ", 1)[0]
    rows = [[x.strip() for x in line.strip("|").split("|")] for line in block.splitlines() if line.startswith("| ")]
    return {r[0]: r for r in rows[1:]}


@pytest.mark.parametrize("source", sorted(PEERS))
def test_serve_rows_are_each_runs_figures_and_their_median(source):
    docs = _load(PEERS[source])
    doc = combine.combine(*combine.load(PEERS[source]))
    md = combine.markdown(doc)
    for case in (c["case"] for c in doc["cases"]):
        rows = _rows(md, case)
        for side, row in rows.items():
            runs = [(_side(d, _serve_key, case, side) or {}).get("decode_tokens_per_s") for d in docs]
            assert row[1] == " / ".join(_cell(r) for r in runs)
            have = [r["median"] for r in runs if r]
            assert row[2].startswith(f"{statistics.median(have):.1f}") if have else row[2] == "–"
            # the bench's own x_plain per run is what the ratio is made of
            if side != "plain" and have:
                ours = next(s for c in doc["cases"] if c["case"] == case for s in c["sides"] if s["side"] == side)
                wrote = [(_side(d, _serve_key, case, side) or {}).get("x_plain") for d in docs]
                assert ours["x_plain"]["runs"] == pytest.approx([x for x in wrote if x is not None])


def _ratio(doc: dict, case: str, side: str) -> dict:
    return next(s for c in doc["cases"] if c["case"] == case for s in c["sides"] if s["side"] == side)["port_over_side"]


def test_a_ratio_that_moves_past_its_spread_is_a_range():
    runs = list(zip(PEERS["dflash"], _load(PEERS["dflash"])))
    doc = combine.combine("serve", runs)
    # in the runs as measured: z-lab's loop agreeing holds its ratio, at tau 1 it moves
    held, moved = _ratio(doc, "agreeing: dflash-agreeing", "zlab-mlx"), _ratio(doc, "random: dflash-qwen3-4b", "zlab-mlx")
    assert not held["moved"] and held["text"] == f"{statistics.median(held['runs']):.2f}×"
    assert moved["moved"] and moved["text"] == f"{min(moved['runs']):.2f}–{max(moved['runs']):.2f}×"
    # negative controls, planted in the data: run 2's z-lab side 1.5x faster or slower, spread and all
    for factor in (1.5, 1 / 1.5):
        planted = copy.deepcopy(runs)
        z = _side(planted[1][1], _serve_key, "agreeing: dflash-agreeing", "zlab-mlx")["decode_tokens_per_s"]
        for k in ("median", "p10", "p90"):
            z[k] *= factor
        shifted = _ratio(combine.combine("serve", planted), "agreeing: dflash-agreeing", "zlab-mlx")
        assert shifted["moved"] and "–" in shifted["text"], factor
    # and a shift inside the spread keeps one value
    planted = copy.deepcopy(runs)
    z = _side(planted[1][1], _serve_key, "agreeing: dflash-agreeing", "zlab-mlx")["decode_tokens_per_s"]
    z["median"] += (z["p90"] - z["median"]) / 10
    assert not _ratio(combine.combine("serve", planted), "agreeing: dflash-agreeing", "zlab-mlx")["moved"]


def test_bench_rows_are_per_step_and_ratios_are_the_runners_own():
    docs = _load(BENCH)
    doc = combine.combine(*combine.load(BENCH))
    md = combine.markdown(doc)
    for c in doc["cases"]:
        rows = _rows(md, c["case"])
        for s in c["sides"]:
            raw = [_side(d, lambda x: x["case"], c["case"], s["side"]) for d in docs]
            steps = [next(x for x in d["cases"] if x["case"] == c["case"])["steps_per_call"] for d in docs]
            assert rows[s["side"]][1] == " / ".join(_cell(r["wall_s"], 1e3 / k, 3) for r, k in zip(raw, steps))
            assert s["x_floor"]["runs"] == pytest.approx([r["x_floor"] for r in raw])
            if s["side"] != "port":
                assert s["port_speedup_over_side"]["runs"] == pytest.approx([r["port_speedup"] for r in raw])


def test_out_writes_the_table_and_its_json(tmp_path, capsys):
    assert cli.main(["combine", str(BENCH[0]), str(BENCH[1]), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "combined.md").read_text().strip() in printed
    assert json.loads((tmp_path / "combined.json").read_text()) == combine.combine(*combine.load(BENCH))


def _copy(tmp_path: Path, src: Path, name: str, change=None) -> Path:
    doc = json.loads(src.read_text())
    if change:
        change(doc)
    (tmp_path / name).mkdir()
    out = tmp_path / name / ("bench.json" if "bandwidth" in doc else "serve.json")
    out.write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize("bad", ["one run", "the same run twice", "a copy of it", "two kinds", "two trees",
                                 "other options", "not json", "missing", "empty folder"])
def test_runs_that_cannot_make_one_figure_are_refused_in_one_line(bad, tmp_path, capsys):
    a = str(_copy(tmp_path, PEERS["dflash"][0], "a"))
    second = {
        "one run": lambda: None,
        "the same run twice": lambda: a,
        "a copy of it": lambda: str(_copy(tmp_path, PEERS["dflash"][0], "b")),
        "two kinds": lambda: str(BENCH[0]),
        "two trees": lambda: str(_copy(tmp_path, PEERS["dflash"][1], "b",
                                       lambda d: d["project"].update(source_sha256="0" * 64))),
        "other options": lambda: str(_copy(tmp_path, PEERS["dflash"][1], "b",
                                           lambda d: d["options"].update(new_tokens=128))),
        "not json": lambda: str(tmp_path / "a" / "x.json"),
        "missing": lambda: str(tmp_path / "nowhere.json"),
        "empty folder": lambda: str(tmp_path),
    }
    b = second[bad]()
    if bad == "not json":
        Path(b).write_text("serve.json, half written")
    argv = ["combine", a] + ([b] if b else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("spec-parity combine: error: ")
    named = {"one run": "at least 2 runs", "the same run twice": "the same run", "a copy of it": "the same run", "two kinds": "two kinds", "two trees": "one tree",
             "other options": "new_tokens", "not json": "x.json", "missing": "nowhere.json",
             "empty folder": str(tmp_path)}[bad]
    assert named in err


def test_runs_made_with_other_mlx_settings_are_refused():
    """Serving runs of one tree, two with MLX CUDA's graphs at 10 ops: those two combine, and one of
    each does not (that setting moves the figures: docs/bench.md, "MLX settings move the figures")."""
    default, ops10 = ([RUNS / f"serve-dflash-h100-{k}-{i}.json" for i in (1, 2)] for k in ("default", "ops10"))
    for paths in (default, ops10):
        combine.load(paths)
    with pytest.raises(combine.CombineError, match="MLX_MAX_OPS_PER_BUFFER=10"):
        combine.load([default[0], ops10[0]])


def test_a_folder_stands_for_its_run(tmp_path):
    a = _copy(tmp_path, PEERS["dspark"][0], "a").parent
    b = _copy(tmp_path, PEERS["dspark"][1], "b").parent
    kind, runs = combine.load([a, b])
    assert kind == "serve" and [p.name for p, _ in runs] == ["serve.json", "serve.json"]


def test_every_run_pair_in_benchmarks_combines():
    """Each run file in benchmarks/ with its second run makes a table."""
    firsts = [p for p in sorted(RUNS.glob("*-1.json")) if p.name != "step-h100-1.json"]  # its pair: below
    assert len(firsts) >= 8
    for first in firsts:
        paths = [first, first.with_name(first.name.replace("-1.json", "-2.json"))]
        doc = combine.combine(*combine.load(paths))
        assert doc["cases"] and all(c["sides"] for c in doc["cases"]), paths
        assert combine.markdown(doc).count("\n## ") == len(doc["cases"])


def test_a_run_not_shaped_as_the_bench_writes_is_refused(tmp_path):
    bad = tmp_path / "serve.json"
    bad.write_text(json.dumps({"cases": [{"case": "x", "condition": "random", "status": "ok", "sides": [{}]}]}))
    with pytest.raises(combine.CombineError, match="not what spec-parity bench writes"):
        combine.load([bad, PEERS["dflash"][0]])


# ---- docs/benchmarks.md held to the run files it names ---------------------------------------------

def _blocks(text: str, opener: str) -> list[tuple[str, str]]:
    """Each paragraph opening with `opener` and the text after it, up to the next such paragraph
    or section."""
    parts = re.split(rf"(?m)^(?={re.escape(opener)}|## )", text)
    return [(p.split("\n\n", 1)[0], p) for p in parts if p.startswith(opener)]


def _named(head: str) -> list[Path]:
    return [ROOT / f for f in re.findall(r"`(benchmarks/[^`]+)`", head)]


def _table_rows(doc: dict) -> list[str]:
    return [line for line in combine.markdown(doc).splitlines()
            if (line.startswith("| ") and not line.startswith("| side")) or line.startswith("Floor ms")]


def _combined(paths: list[Path]) -> dict:
    """The runs' table: combine's own combined.json where the page names one, else combine of the runs."""
    first = json.loads(paths[0].read_text())
    return first if "kind" in first and "runs" in first else combine.combine(*combine.load(paths[:2]))


def _facts(paths: list[Path]) -> list[tuple[str, str, str]]:
    """(machine model, commit, command) of each run the paths hold."""
    docs = [json.loads(p.read_text()) for p in paths]
    if "kind" in docs[0]:   # combined.json: its runs' machines and commands; the commit from its first run's file
        commit = docs[1]["project"]["commit"]
        return [(r["machine"].split(",")[0], commit, r["command"]) for r in docs[0]["runs"]]
    return [(d["machine"]["mlx_device_info"]["device_name"], d["project"]["commit"], d["command"]) for d in docs]


def _bench_command(command: str) -> str:
    return "spec-parity " + command.split(" -m spec_parity.cli ", 1)[1].split(" --out ", 1)[0]


def tables_are_their_runs(text: str) -> int:
    """Each "Runs:" paragraph names its run files, the machine they ran on, the tree and the command;
    the table under it is what combine prints for them. Returns the number of tables checked."""
    blocks = _blocks(text, "Runs: ")
    for head, block in blocks:
        paths = _named(head)
        assert paths, head
        rows = _table_rows(_combined(paths))
        assert rows and not [r for r in rows if r not in block], head
        flat = " ".join(head.split())
        for machine, commit, command in _facts(paths):
            assert f"on {machine}, tree {commit[:7]}" in flat, (head, machine, commit[:7])
            assert f"`{_bench_command(command)}`" in flat, (head, _bench_command(command))
    return len(blocks)


def log_tables_are_their_logs(text: str) -> int:
    """Each "From `benchmarks/<name>.log`" paragraph's tables quote only figures that log holds, and its
    machine and tree are the log's."""
    blocks = _blocks(text, "From `benchmarks/")
    for head, block in blocks:
        (log,) = _named(head)
        raw = log.read_text()
        first = raw.splitlines()[0]
        machine, tree = re.search(r"on (.+?), tree ([0-9a-f]{7})", " ".join(head.split())).groups()
        assert machine in first and f"tree {tree}" in first, (head, first)
        rows = [line for line in block.splitlines() if line.startswith("| ") and not re.match(r"\| (block|setting|case) ", line)]
        figures = [f for line in rows for f in re.findall(r"\d+\.\d{3}", line)]
        figures += re.findall(r"(\d+ passed, \d+ skipped, \d+ xfailed)", block)
        assert not [f for f in figures if f not in raw], (head, [f for f in figures if f not in raw])
    return len(blocks)


def test_each_table_on_the_benchmarks_page_is_combine_of_the_runs_it_names():
    assert tables_are_their_runs(PAGE.read_text()) >= 8


def test_each_table_on_the_bench_page_is_combine_of_the_runs_it_names():
    assert tables_are_their_runs((ROOT / "docs" / "bench.md").read_text()) == 2


def test_each_host_time_table_quotes_its_log():
    assert log_tables_are_their_logs(PAGE.read_text()) == 3


def test_the_headline_quotes_the_tables():
    """Every figure of the page's opening list is in one of its tables."""
    text = PAGE.read_text()
    headline = next(p for p in text.split("\n\n") if p.startswith("- **"))
    tables = "\n".join(line for line in text.splitlines() if line.startswith("| ") or line.startswith("Floor ms"))
    figures = re.findall(r"\d{2,}\.\d|\d\.\d{2,}", headline)
    assert len(figures) >= 20 and not [f for f in figures if f not in tables], figures


def test_the_step_files_first_run_is_its_bench_json():
    """The step table's runs are combine's combined.json (its second run's bench.json is not kept);
    its first run is benchmarks/step-h100-1.json, recombined here."""
    doc = json.loads((RUNS / "step-h100-combined.json").read_text())
    first = RUNS / "step-h100-1.json"
    alone = combine.combine("bench", [(first, json.loads(first.read_text()))] * 2)
    assert doc["tree"] == alone["tree"]
    for c, c1 in zip(doc["cases"], alone["cases"], strict=True):
        assert c["floor_step_s"][0] == c1["floor_step_s"][0] and c["rounds"][0] == c1["rounds"][0]
        assert [s["step_s"][0] for s in c["sides"]] == [s["step_s"][0] for s in c1["sides"]]


@pytest.mark.parametrize("pasted, edited, check", [
    ("| 80.9 | 0.46–0.51× |", "| 81.0 | 0.46–0.51× |", tables_are_their_runs),
    ("| 2.197 | 3.15× |", "| 2.198 | 3.15× |", tables_are_their_runs),
    ("| 870.7 | 6.65–8.51× |", "| 870.8 | 6.65–8.51× |", tables_are_their_runs),
    ("`benchmarks/serve-dspark-h200-peers-2.json` on\nNVIDIA H200, tree 32fcfe1",
     "`benchmarks/serve-dspark-h200-peers-2.json` on\nNVIDIA H100 80GB HBM3, tree 32fcfe1", tables_are_their_runs),
    ("`benchmarks/serve-assistant-h100-2.json` on NVIDIA\nH100 80GB HBM3, tree 3ae854a",
     "`benchmarks/serve-assistant-h100-2.json` on NVIDIA\nH100 80GB HBM3, tree 8066869", tables_are_their_runs),
    ("--new-tokens 64 --peers optiq`", "--new-tokens 128 --peers optiq`", tables_are_their_runs),
    ("| 0.900 / 0.937 / 0.897 |", "| 0.900 / 0.937 / 0.898 |", log_tables_are_their_logs),
    ("200 passed, 8 skipped, 3 xfailed", "201 passed, 8 skipped, 3 xfailed", log_tables_are_their_logs),
], ids=["serving-median", "step-median", "tau-median", "machine", "tree", "command", "host-time", "gpu-tests"])
def test_a_page_edit_the_runs_do_not_say_fails_its_check(pasted, edited, check):
    """Control of the page checks: one figure, machine, tree or command changed in the text fails
    its check, which passes on the text as it is."""
    text = PAGE.read_text()
    assert text.count(pasted) == 1, pasted
    check(text)
    with pytest.raises(AssertionError):
        check(text.replace(pasted, edited))
