"""`spec-parity combine`: the table it prints is the runs' own figures (checked against the JSON
the bench wrote, and against the docs' session-12 serving table made from the same files), a ratio
that moves more than its spread becomes a range (a shift planted in one run's data turns a single
value into one), and runs that cannot make one figure are refused in one line."""

from __future__ import annotations

import copy
import json
import re
import statistics
from pathlib import Path

import pytest

from spec_parity import cli
from spec_parity.bench import combine

DOCS = Path(__file__).resolve().parent.parent / "docs"
S12 = {src: [DOCS / f"serve-h200-{src}-s12-run{i}.json" for i in (1, 2)] for src in ("dflash", "dspark")}
BENCH = [DOCS / f"bench-h200-run{i}.json" for i in (38, 39)]


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


@pytest.mark.parametrize("source", sorted(S12))
def test_serve_rows_are_each_runs_figures_and_their_median(source):
    docs = _load(S12[source])
    doc = combine.combine(*combine.load(S12[source]))
    md = combine.markdown(doc)
    for case in (c["case"] for c in doc["cases"]):
        rows = _rows(md, case)
        for side, row in rows.items():
            runs = [(_side(d, _serve_key, case, side) or {}).get("decode_tokens_per_s") for d in docs]
            assert row[1] == " / ".join(_cell(r) for r in runs)
            have = [r["median"] for r in runs if r]
            assert row[2].startswith(f"{statistics.median(have):.1f}")
            # the bench's own x_plain per run is what the ratio is made of
            if side != "plain":
                ours = next(s for c in doc["cases"] if c["case"] == case for s in c["sides"] if s["side"] == side)
                wrote = [(_side(d, _serve_key, case, side) or {}).get("x_plain") for d in docs]
                assert ours["x_plain"]["runs"] == pytest.approx([x for x in wrote if x is not None])


def test_docs_session12_serving_table_is_what_its_runs_say():
    """docs/benchmarks.md's session-12 table (tree 5f034dc) against combine on its committed runs."""
    text = (DOCS / "benchmarks.md").read_text()
    table = text.split("### Serving conditions (`bench --serve`, two runs per source, tree 5f034dc)", 1)[1]
    table = table.split("\n\n- ", 1)[0]
    rows = [[x.strip() for x in line.strip("|").split("|")] for line in table.splitlines()
            if re.match(r"\| D(Flash|Spark) ", line)]
    assert len(rows) == 4
    for name, plain, ours, peer, deepspec in rows:
        source = name.split()[0].lower()
        condition = name.split()[1]
        doc = combine.combine(*combine.load(S12[source]))
        case = next(c for c in doc["cases"] if c["case"].startswith(condition))
        printed = _rows(combine.markdown(doc), case["case"])
        strip = lambda cell: re.sub(r"\s*\(τ [^)]*\)$", "", cell.replace("**", ""))  # noqa: E731
        assert strip(plain) == printed["plain"][1]
        assert strip(ours) == printed["port"][1]
        assert strip(peer) == printed["zlab-mlx" if source == "dflash" else "dspark-mlx"][1]
        assert strip(deepspec) == (printed["deepspec-torch"][1] if "deepspec-torch" in printed else "–")


def _ratio(doc: dict, case: str, side: str) -> dict:
    return next(s for c in doc["cases"] if c["case"] == case for s in c["sides"] if s["side"] == side)["port_over_side"]


def test_a_ratio_that_moves_past_its_spread_is_a_range():
    runs = list(zip(S12["dflash"], _load(S12["dflash"])))
    doc = combine.combine("serve", runs)
    # in the runs as measured: z-lab's loop at tau 1 holds its ratio, the agreeing pair's moves
    held, moved = _ratio(doc, "random: dflash-qwen3-4b", "zlab-mlx"), _ratio(doc, "agreeing: dflash-agreeing", "zlab-mlx")
    assert not held["moved"] and held["text"] == f"{statistics.median(held['runs']):.2f}×"
    assert moved["moved"] and moved["text"] == f"{min(moved['runs']):.2f}–{max(moved['runs']):.2f}×"
    # negative controls, planted in the data: run 2's z-lab side 1.5x faster or slower, spread and all
    for factor in (1.5, 1 / 1.5):
        planted = copy.deepcopy(runs)
        z = _side(planted[1][1], _serve_key, "random: dflash-qwen3-4b", "zlab-mlx")["decode_tokens_per_s"]
        for k in ("median", "p10", "p90"):
            z[k] *= factor
        shifted = _ratio(combine.combine("serve", planted), "random: dflash-qwen3-4b", "zlab-mlx")
        assert shifted["moved"] and "–" in shifted["text"], factor
    # and a shift inside the spread keeps one value
    planted = copy.deepcopy(runs)
    z = _side(planted[1][1], _serve_key, "random: dflash-qwen3-4b", "zlab-mlx")["decode_tokens_per_s"]
    z["median"] = (z["median"] + z["p90"]) / 2
    assert not _ratio(combine.combine("serve", planted), "random: dflash-qwen3-4b", "zlab-mlx")["moved"]


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
    a = str(_copy(tmp_path, S12["dflash"][0], "a"))
    second = {
        "one run": lambda: None,
        "the same run twice": lambda: a,
        "a copy of it": lambda: str(_copy(tmp_path, S12["dflash"][0], "b")),
        "two kinds": lambda: str(BENCH[0]),
        "two trees": lambda: str(_copy(tmp_path, S12["dflash"][1], "b",
                                       lambda d: d["project"].update(source_sha256="0" * 64))),
        "other options": lambda: str(_copy(tmp_path, S12["dflash"][1], "b",
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
    """Session 25's serving runs of one tree, two with MLX CUDA's graphs at 10 ops: those two
    combine, and one of each does not (that setting moved the figures, "Session 25")."""
    default, ops10 = ([DOCS / f"serve-h100-dflash-s25-{k}-run{i}.json" for i in (1, 2)] for k in ("default", "ops10"))
    for paths in (default, ops10):
        combine.load(paths)
    with pytest.raises(combine.CombineError, match="MLX_MAX_OPS_PER_BUFFER=10"):
        combine.load([default[0], ops10[0]])


def test_a_folder_stands_for_its_run(tmp_path):
    a = _copy(tmp_path, S12["dspark"][0], "a").parent
    b = _copy(tmp_path, S12["dspark"][1], "b").parent
    kind, runs = combine.load([a, b])
    assert kind == "serve" and [p.name for p, _ in runs] == ["serve.json", "serve.json"]


def test_every_committed_run_pair_combines():
    """docs/ keeps every run its figures came from; each pair of one tree makes a table (the
    session-8 runs name their tree in the older `git` field)."""
    pairs = [[DOCS / f"serve-h200-{src}-run{i}.json" for i in (1, 2)] for src in ("assistant", "dflash", "dspark")]
    pairs += [[p, Path(str(p).replace("run1", "run2"))] for p in sorted(DOCS.glob("serve-h200-*-s*-run1.json"))]
    pairs += [[DOCS / f"bench-h200-run{i}.json" for i in group] for group in ((6, 7), (8, 9, 10), (22, 23), (33, 34, 35))]
    for paths in pairs:
        doc = combine.combine(*combine.load(paths))
        assert doc["cases"] and all(c["sides"] for c in doc["cases"]), paths
        assert combine.markdown(doc).count("\n## ") == len(doc["cases"])


def test_a_run_not_shaped_as_the_bench_writes_is_refused(tmp_path):
    bad = tmp_path / "serve.json"
    bad.write_text(json.dumps({"cases": [{"case": "x", "condition": "random", "status": "ok", "sides": [{}]}]}))
    with pytest.raises(combine.CombineError, match="not what spec-parity bench writes"):
        combine.load([bad, S12["dflash"][0]])


def test_every_committed_serving_figure_is_in_the_docs_as_combine_prints_it():
    """Each run's tok/s of every side the docs tabulate, for every committed serve pair (sessions
    8-13; session 11's opt-in paths are quoted in prose, medians only, so its tables' sides)."""
    text = (DOCS / "benchmarks.md").read_text()
    tabulated = {"plain", "port", "port-bucketed", "port-plain", "port-unfused", "port-sdpa", "optiq", "zlab-mlx",
                 "dflash-mlx", "dspark-mlx", "deepspec-torch"}
    pairs = [[DOCS / f"serve-h200-{src}-run{i}.json" for i in (1, 2)] for src in ("assistant", "dflash", "dspark")]
    pairs += [[p, Path(str(p).replace("run1", "run2"))] for p in sorted(DOCS.glob("serve-h200-*-s*-run1.json"))]
    for paths in pairs:
        doc = combine.combine(*combine.load(paths))
        for c in doc["cases"]:
            for s in c["sides"]:
                prose = "-s11-" in paths[0].name and s["side"].startswith("port-")
                if s["side"] in tabulated and not prose:
                    for f in s["tokens_per_s"]:
                        assert f is None or _cell(f) in text, (paths[0].name, c["case"], s["side"], _cell(f))


def test_cold_and_warm_rounds_are_the_serve_sections_and_hold_the_targets_row():
    """The bench runs' serve section (item 2: cold round within 1.5x of warm) per run, and the
    assistant's range that docs/benchmarks.md's targets table quotes from runs 22-23 and 36-39."""
    ratios = {}
    for group in ((22, 23), (36, 37), (38, 39)):
        paths = [DOCS / f"bench-h200-run{i}.json" for i in group]
        doc = combine.combine(*combine.load(paths))
        md = combine.markdown(doc)
        for c, raw in zip(doc["cases"], zip(*(_load(paths)[i]["cases"] for i in range(len(paths))))):
            for r, case in zip(c["rounds"], raw):
                sv = case["serve"]
                assert r == {"warm_s": sv["round_median_s"]["round_s"], "cold_s": sv["cold"]["round_median_s"]["round_s"]}
                assert f"({r['cold_s'] / r['warm_s']:.2f}×)" in md
                ratios.setdefault(c["case"], []).append(r["cold_s"] / r["warm_s"])
    text = (DOCS / "benchmarks.md").read_text()
    for case, label in (("assistant-12b-tied", "12B"), ("assistant-e4b-centroid", "E4B")):
        assert f"{label} {min(ratios[case]):.2f}–{max(ratios[case]):.2f}" in text


def test_the_targets_rows_cold_over_warm_figures_are_the_runs():
    """Item 2's row quotes the default loop's cold ÷ warm round of runs 13-35 (sessions 9-12), as
    ranges or run by run; each is recomputed here from the committed runs (runs 18-21's DFlash
    figures were once those of another path, serve_unfused)."""
    def ratios(runs, source):
        out = []
        for r in runs:
            case = next(c for c in json.loads((DOCS / f"bench-h200-run{r}.json").read_text())["cases"]
                        if c["case"].startswith(source))
            sv = case["serve"]
            out.append(sv["cold"]["round_median_s"]["round_s"] / sv["round_median_s"]["round_s"])
        return out

    def run_by_run(v):
        return " / ".join(f"{x:.2f}" for x in v)

    def span(v):
        return f"{min(v):.2f}–{max(v):.2f}"

    row = next(line for line in (DOCS / "benchmarks.md").read_text().splitlines()
               if line.startswith("| 2. the default path pays no per-length plan"))
    later = (28, 29, 32, 33, 34, 35)
    for source, quoted in (("dspark", [span(ratios(range(13, 18), "dspark")), run_by_run(ratios(range(18, 22), "dspark")),
                                       run_by_run(ratios((24, 27), "dspark")), span(ratios(later, "dspark"))]),
                           ("dflash", [span(ratios(range(13, 18), "dflash")), run_by_run(ratios(range(18, 22), "dflash")),
                                       run_by_run(ratios(range(24, 28), "dflash")), span(ratios(later, "dflash"))])):
        for q in quoted:
            assert q in row, (source, q)
    text = (DOCS / "benchmarks.md").read_text().replace("\n  ", " ")
    assert f"DFlash {run_by_run(ratios(later, 'dflash'))}, DSpark {run_by_run(ratios(later, 'dspark'))}" in text


def test_the_targets_rows_step_ratios_are_the_runs():
    """Items 3a-3c quote, per run, the default block against the best MLX peer and against the
    floor; each is recomputed from the committed runs (run 26's 0.87 once read 0.86: a ratio of
    rounded times)."""
    def side(r, source, name):
        case = next(c for c in json.loads((DOCS / f"bench-h200-run{r}.json").read_text())["cases"]
                    if c["case"].startswith(source))
        return case, next(s for s in case["sides"] if s["side"] == name)

    def over(runs, source, peer):   # the peer's time over ours: our speed-up
        return [side(r, source, peer)[1]["wall_s"]["median"] / side(r, source, "port")[1]["wall_s"]["median"]
                for r in runs]

    def floor(runs, source):
        return [side(r, source, "port")[1]["x_floor"] for r in runs]

    def each(v, digits=2):
        return " / ".join(f"{x:.{digits}f}" for x in v)

    def span(v, digits=2):
        return f"{min(v):.{digits}f}–{max(v):.{digits}f}"

    rows = {line.split("|")[1].strip()[:3]: line for line in (DOCS / "benchmarks.md").read_text().splitlines()
            if re.match(r"\| 3[abc]\. ", line)}
    s12 = (28, 29, 32, 33, 34, 35)
    quoted = [
        ("3a.", f"{each(over((24, 25, 26, 27), 'dflash', 'zlab-mlx'))}× (24–27)"),
        ("3a.", f"{each(over((28, 29, 32), 'dflash', 'zlab-mlx'))}× (28, 29, 32)"),
        ("3a.", f"{each(over((33, 34, 35), 'dflash', 'zlab-mlx'))}× (33–35)"),
        ("3a.", f"**{' / '.join(f'{x:.2f}×' for x in over((43, 44), 'dflash', 'zlab-mlx'))}** (43, 44"),
        ("3b.", f"DSpark {span(over((18, 19, 20, 21), 'dspark', 'dspark-mlx'))}× dspark-mlx (18–21)"),
        ("3b.", f"{each(over((24, 27), 'dspark', 'dspark-mlx'))}× (24, 27)"),
        ("3b.", f"{span(over(s12, 'dspark', 'dspark-mlx'))}× (28–35)"),
        ("3b.", f"{each(over((43, 44), 'dspark', 'dspark-mlx'))}× (43, 44)"),
        ("3b.", f"DFlash {span(over(s12, 'dflash', 'zlab-mlx'))}× z-lab MLX (28–35)"),
        ("3c.", f"DFlash {span(floor(s12[:5], 'dflash'), 1)}×, DSpark {span(floor(s12[:5], 'dspark'), 1)}× (28–34"),
        ("3c.", f"{floor((35,), 'dflash')[0]:.1f} / {floor((35,), 'dspark')[0]:.1f}×"),
        ("3c.", f"DFlash {each(floor((43, 44), 'dflash'))}×, DSpark {each(floor((43, 44), 'dspark'))}× (43, 44)"),
    ]
    missing = [(row, text) for row, text in quoted if text not in rows[row]]
    assert not missing, missing


def pasted_tables_are_combines(text: str, paths: list) -> None:
    """Every row of `combine`'s table of the runs at `paths` is in `text`."""
    pasted_rows_are(text, combine.combine(*combine.load(paths)), paths[0].name)


def pasted_rows_are(text: str, doc: dict, name: str = "") -> None:
    """Every row of the table of combine's `doc` is in `text`."""
    rows = [line for line in combine.markdown(doc).splitlines()
            if line.startswith("| ") and not line.startswith("| side")]
    assert rows and not [r for r in rows if r not in text], name


def cold_over_warm(paths: list) -> dict:
    """source -> its serve sections' cold ÷ warm rounds, run by run, as the targets row gives them."""
    cold = {}
    for p in paths:
        for c in json.loads(p.read_text())["cases"]:
            sv = c["serve"]
            cold.setdefault(c["case"].split("-")[0], []).append(
                f"{sv['cold']['round_median_s']['round_s'] / sv['round_median_s']['round_s']:.2f}")
    return {src: " / ".join(r) for src, r in cold.items()}


def targets_row(text: str, n: int) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {n}. "))


def test_session_19s_tables_are_combine_of_its_runs():
    """Session 19 (an H100) pasted `combine`'s tables of its committed runs: every table row of
    each combination is in docs/benchmarks.md as combine prints it, and the targets table's cold ÷
    warm figures for runs 45-50 are the runs' serve sections."""
    text = (DOCS / "benchmarks.md").read_text()
    groups = [[DOCS / f"serve-h100-{src}-s19-run{i}.json" for i in (1, 2)] for src in ("dflash", "dspark", "assistant")]
    groups += [[DOCS / f"bench-h100-run{i}.json" for i in runs] for runs in ((45, 46, 47, 48), (49, 50))]
    for paths in groups:
        pasted_tables_are_combines(text, paths)

    def ratios(runs, source):
        out = []
        for r in runs:
            case = next(c for c in json.loads((DOCS / f"bench-h100-run{r}.json").read_text())["cases"]
                        if c["case"].startswith(source))
            out.append(case["serve"]["cold"]["round_median_s"]["round_s"] / case["serve"]["round_median_s"]["round_s"])
        return " / ".join(f"{x:.2f}" for x in out)

    row = next(line for line in text.splitlines() if line.startswith("| 2. the default path pays no per-length plan"))
    for quoted in (f"DSpark {ratios(range(45, 49), 'dspark')}, DFlash {ratios(range(45, 49), 'dflash')}",
                   f"12B {ratios((49, 50), 'assistant-12b')}, E4B {ratios((49, 50), 'assistant-e4b')}"):
        assert quoted in row, quoted


def test_session_20s_tables_are_combine_of_its_runs():
    """Session 20 (an H100) pasted `combine`'s tables of its committed runs (serving, and the step
    with the scatter: runs 51, 53), and its before/after table quotes the serve section's round
    and the port's block median of runs 51, 53 (after) and 52, 54 (the slice writes, before)."""
    text = (DOCS / "benchmarks.md").read_text()
    after = [DOCS / f"bench-h100-run{i}.json" for i in (51, 53)]
    before = [DOCS / f"bench-h100-run{i}-slice-writes.json" for i in (52, 54)]
    for paths in [[DOCS / f"serve-h100-{src}-s20-run{i}.json" for i in (1, 2)] for src in ("dflash", "dspark")] + [after]:
        pasted_tables_are_combines(text, paths)

    def cases(paths, source):
        return [next(c for c in json.loads(p.read_text())["cases"] if c["case"].startswith(source)) for p in paths]

    def rounds(paths, source):
        return " / ".join(f"{c['serve']['round_median_s']['round_s'] * 1e3:.2f}" for c in cases(paths, source))

    def block(paths, source):
        table = combine.markdown(combine.combine(*combine.load(paths)))
        part = table.split(f"## {source}")[1]
        return next(line for line in part.splitlines() if line.startswith("| port |")).split(" | ")[2]

    lines = text.splitlines()
    for name, source in (("DFlash", "dflash"), ("DSpark", "dspark")):
        row = next(line for line in lines if line.startswith(f"| {name} serve-section round"))
        assert f"| {rounds(before, source)} | {rounds(after, source)} |" in row, row
        row = next(line for line in lines if line.startswith(f"| {name} block, ms"))
        assert f"| {block(before, source)} | {block(after, source)} |" in row, row
    cold = cold_over_warm(after)
    assert f"(runs 51, 53): DSpark {cold['dspark']}, DFlash {cold['dflash']}" in targets_row(text, 2)


def test_session_21s_tables_are_its_runs():
    """Session 21 (an H100) pasted `combine`'s serving rows of its two kernel-verify runs into
    docs/benchmarks.md, and run 55's step rows (one run) into docs/benchmarks-history.md: each row
    is recomputed from the committed JSON."""
    paths = [DOCS / f"serve-h100-dflash-s21-kv-run{i}.json" for i in (1, 2)]
    rows = [line for line in combine.markdown(combine.combine(*combine.load(paths))).splitlines()
            if line.startswith("| ") and not line.startswith("| side")]
    text = (DOCS / "benchmarks.md").read_text()
    assert len(rows) == 6 and not [r for r in rows if r not in text]
    history = (DOCS / "benchmarks-history.md").read_text()
    for case in json.loads((DOCS / "bench-h100-run55.json").read_text())["cases"]:
        for side in case["sides"]:
            name = f"**{side['side']}**" if side["side"] == "port" else side["side"]
            wall = side["wall_s"]
            row = (f"| {case['case']} | {name} | {side['per_step_s'] * 1e3:.3g} | {wall['p10'] * 1e3:.3g}–"
                   f"{wall['p90'] * 1e3:.3g} | {side['x_floor']:.2f}× | {side['cold_wall_s']['median'] * 1e3:.3g} |")
            assert row in history, row


S22_PAIRS = ([[DOCS / f"serve-h200-{src}-s22-run{i}.json" for i in (1, 2)] for src in ("dflash", "dspark")]
             + [[DOCS / f"serve-h200-{src}-s22-kv-run{i}.json" for i in (3, 4)] for src in ("dflash", "dspark")]
             + [[DOCS / f"serve-h100-{src}-s22-aa-run{i}.json" for i in (1, 2)] for src in ("dflash", "dspark")])


def test_session_22s_tables_are_its_runs():
    """Session 22 (an H200, then H100s) pasted `combine`'s tables of its committed runs (the step,
    runs 56 and 57; serving beside the peers; the kernel verify against the compiled one, with the
    A/A side), the cold ÷ warm rounds of runs 56 and 57 into the targets row, and the inverse of
    the kernel verify's `port ÷ side` (and of port-again's) per pair into its summary table."""
    text = (DOCS / "benchmarks.md").read_text()
    step = [DOCS / f"bench-h200-run{i}.json" for i in (56, 57)]
    for paths in S22_PAIRS + [step]:
        pasted_tables_are_combines(text, paths)
    cold = cold_over_warm(step)
    assert f"(runs 56, 57, the compiled verify, the default at 32fcfe1): DSpark {cold['dspark']}, " \
           f"DFlash {cold['dflash']}" in targets_row(text, 2)

    def inverse(paths, side):
        doc = combine.combine(*combine.load(paths))
        r = next(s for s in doc["cases"][0]["sides"] if s["side"] == side)["port_over_side"]
        inv = [1 / x for x in r["runs"]]
        return f"{min(inv):.2f}–{max(inv):.2f}×" if r["moved"] else f"{1 / statistics.median(r['runs']):.2f}×"

    table = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| H200, runs") or
             line.startswith("| H100, with the A/A")}
    (d12, s12), (d34, s34), (daa, saa) = (S22_PAIRS[i:i + 2] for i in (0, 2, 4))
    assert f"| {inverse(d12, 'port-kernel-verify')} | {inverse(s12, 'port-kernel-verify')} |" in table["H200, runs 1–2 (with the peers)"]
    assert f"| {inverse(d34, 'port-kernel-verify')} | {inverse(s34, 'port-kernel-verify')} |" in table["H200, runs 3–4"]
    assert (f"| {inverse(daa, 'port-kernel-verify')} (A/A: {inverse(daa, 'port-again')}) | "
            f"{inverse(saa, 'port-kernel-verify')} (A/A: {inverse(saa, 'port-again')}) |") in table["H100, with the A/A control"]


def test_session_23s_tables_are_its_runs():
    """Session 23 (an H100) pasted `combine`'s step table of runs 58 and 59 (the kernel verify the
    default) and their cold ÷ warm rounds into the targets row and its section."""
    text = (DOCS / "benchmarks.md").read_text()
    step = [DOCS / f"bench-h100-run{i}.json" for i in (58, 59)]
    pasted_tables_are_combines(text, step)
    cold = cold_over_warm(step)
    assert f"(runs 58, 59, the kernel verify, the default at 4f90e3f): DSpark {cold['dspark']}, " \
           f"DFlash {cold['dflash']}" in targets_row(text, 2)
    assert f"(DSpark {cold['dspark']},\nDFlash {cold['dflash']})" in text


S24_SERVE_DFLASH = [DOCS / f"serve-h100-dflash-s24-qk-run{i}.json" for i in (1, 2)]
S24_STEP = [DOCS / f"bench-h100-run{i}.json" for i in (60, 61)]


def test_session_24s_tables_are_its_runs():
    """Session 24 (an H100) pasted `combine`'s tables of norm_rope against its before
    (port-unfused-qk): serving beside the A/A side, two runs a source, and the step (runs 60, 61)."""
    text = (DOCS / "benchmarks.md").read_text()
    for src in ("dflash", "dspark"):
        pasted_tables_are_combines(text, [DOCS / f"serve-h100-{src}-s24-qk-run{i}.json" for i in (1, 2)])
    pasted_tables_are_combines(text, S24_STEP)


S25_STEP = DOCS / "step-h100-s25-combined.json"


@pytest.mark.parametrize("pasted, edited, check", [
    ("| 63.7 | 0.52–0.64× |", "| 63.8 | 0.52–0.64× |", lambda t: pasted_tables_are_combines(t, S24_SERVE_DFLASH)),
    ("| 2.298 | 3.24× |", "| 2.299 | 3.24× |", lambda t: pasted_tables_are_combines(t, S24_STEP)),
    ("| 2.197 | 3.15× |", "| 2.198 | 3.15× |", lambda t: pasted_rows_are(t, json.loads(S25_STEP.read_text()))),
], ids=["s24-serving", "s24-step", "s25-step-combined"])
def test_a_pasted_figure_edited_fails_the_table_check(pasted, edited, check):
    """Control of the pasted-table checks: one pasted figure (session 24's serving and step
    medians; session 25's step median, held to combine's own combined.json) changed in the text
    fails its check, which passes on the text as it is."""
    text = (DOCS / "benchmarks.md").read_text()
    assert text.count(pasted) == 1
    check(text)
    with pytest.raises(AssertionError):
        check(text.replace(pasted, edited))


def test_session_25s_tables_are_its_runs():
    """Session 25 (an H100) pasted combine's step table of runs 62 and 63 (run 63's bench.json did
    not come back from the device, so its figures are the combined.json combine wrote on the
    device; its first run is run 62's JSON, recombined here), its serving tables of each graph
    setting, and the targets row's cold ÷ warm rounds."""
    text = (DOCS / "benchmarks.md").read_text()
    doc = json.loads(S25_STEP.read_text())
    run62 = DOCS / "bench-h100-run62.json"
    alone = combine.combine("bench", [(run62, json.loads(run62.read_text()))] * 2)
    for c, c62 in zip(doc["cases"], alone["cases"]):
        assert c["floor_step_s"][0] == c62["floor_step_s"][0] and c["rounds"][0] == c62["rounds"][0]
        assert [s["step_s"][0] for s in c["sides"]] == [s["step_s"][0] for s in c62["sides"]]
    pasted_rows_are(text, doc)
    for k in ("default", "ops10"):
        pasted_tables_are_combines(text, [DOCS / f"serve-h100-dflash-s25-{k}-run{i}.json" for i in (1, 2)])
    cold = {c["case"].split("-")[0]: " / ".join(f"{r['cold_s'] / r['warm_s']:.2f}" for r in c["rounds"])
            for c in doc["cases"]}
    assert f"(runs 62, 63, the default at 8066869): DSpark {cold['dspark']}, DFlash {cold['dflash']}" \
        in targets_row(text, 2)
