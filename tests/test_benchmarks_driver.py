"""The benchmark driver and the generated docs, on CPU: every suite parses and expands to runs whose
arguments the runners accept; the driver runs a suite within its budget and stamps the
records; docs/benchmarks.md's tables are what benchmarks/results/ gives, and every figure the
README states is in them."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCHMARKS)

import driver  # noqa: E402
import report  # noqa: E402
from suites import SUITES, Run, Suite, problems  # noqa: E402



class _Parsed(Exception):
    def __init__(self, ns: argparse.Namespace):
        self.ns = ns


def parse_with_script(module: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The namespace the runner's own parser makes of ``argv`` (its main() stops right after parsing)."""
    import importlib

    mod = importlib.import_module(module)
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, argv if args is None else args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [module + ".py", *argv])
    try:
        mod.main(argv)
    except _Parsed as p:
        return p.ns
    finally:
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    raise AssertionError(f"{module}.main() returned without parsing its arguments")


def all_runs():
    return [(s, g, r) for s in SUITES.values() for g, runs in s.runs.items() for r in runs]


def test_suites_are_valid():
    assert {"attention", "train", "longest", "scaling", "hf", "one-gpu"} <= set(SUITES)
    for suite in SUITES.values():
        assert problems(suite) == [], suite.name
    bad = Suite(name="bad", question="", table="", runs={2: (
        Run(name="a", kind="longest", gpus=4, limit_s=700, system="seqpar", model="tiny", seqs=((64, 10), (128, 10))),
        Run(name="a", kind="train", gpus=1, limit_s=10, system="mine", peers=("nope",)))})
    got = "\n".join(problems(bad))
    for what in ("given twice", "needs 4 GPUs on a machine of 2", "limit_s 700", "descending", "unknown system 'mine'",
                 "needs seq", "peer 'nope'"):
        assert what in got


@pytest.mark.timeout(600)
def test_every_run_expands_to_arguments_its_script_accepts(monkeypatch):
    from attention import parse_grid, parse_system

    n = 0
    for suite, gpus, run in all_runs():
        cmd = driver.command(run, out="/tmp/x/r.json", commit="abc1234", deadline=2e9, peak=700.0)
        where = f"{suite.name}/{gpus}/{run.name}"
        if run.kind == "pytest":
            for path in run.args:
                assert os.path.exists(os.path.join(ROOT, path)), where
            continue
        i = next(i for i, x in enumerate(cmd) if x.endswith(".py"))
        assert os.path.exists(os.path.join(ROOT, cmd[i])) and os.path.basename(cmd[i]) == f"{run.kind}.py", where
        assert ((cmd[0] == "python") == ((run.kind, run.mode) in driver.ONE_PROCESS)), where  # torchrun for the others
        argv = cmd[i + 1:]
        rest: list[str] = []
        if "--" in argv:
            argv, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
        assert argv[:1] == ([run.mode] if run.mode else []) or run.mode is None, where
        ns = parse_with_script(run.kind, argv, monkeypatch)
        if rest:  # longest.py hands these to train.py
            parse_with_script("train", ["--system", run.system, *rest], monkeypatch)
        if run.mode == "grid":
            for spec in ns.grid:
                grid = parse_grid(spec, ns)
                assert grid.seqs and grid.heads, where
                for name in grid.systems:
                    if name != "all":
                        parse_system(name, run.gpus)
        assert ns.commit == "abc1234" and ns.out == "/tmp/x/r.json", where
        if (run.kind, run.mode) == ("train", None):
            assert (ns.system, ns.matmul_peak, ns.out) == (run.system, 700.0, "/tmp/x/r.json"), where
            if run.seq is not None:
                assert ns.seq == run.seq and (ns.model == run.model or ns.models), where
        n += 1
    assert n > 40
    assert {(r.kind, r.mode) for _, _, r in all_runs()} >= {("train", None), ("train", "host-adamw"), ("longest", None), ("hf", "finetune"),
                                                            ("hf", "families"), *(("attention", m) for m in ("grid", "local", "rates", "lasp", "matmul"))}


def test_dry_run_prints_each_selected_command(capsys):
    assert driver.main(["run", "train", "--gpus", "4", "--only", "llama3-8b-128k-*", "--dry-run", "--commit", "c0ffee"]) == 0
    out = capsys.readouterr().out
    cmds = [shlex.split(x) for x in out.splitlines() if not x.startswith("#")]
    # a run's own environment comes first (VAR=value), then the timeout
    assert len(cmds) == 5 and all(c[c.index("timeout"):c.index("timeout") + 3] == ["timeout", "-k", "20"] for c in cmds)
    assert all("=" in x for c in cmds for x in c[:c.index("timeout")])
    assert {c[c.index("--system") + 1] for c in cmds} == {"seqpar", "torch_cp", "tp_sp"}
    assert all("--commit" in c and c[c.index("--commit") + 1] == "c0ffee" for c in cmds)
    assert "peers llama3-8b-128k-torch_cp, llama3-8b-128k-tp_sp" in out
    with pytest.raises(SystemExit):
        driver.main(["run", "train", "--gpus", "3", "--dry-run"])  # no runs for 3 GPUs
    with pytest.raises(SystemExit):
        driver.main(["run", "train", "--gpus", "4", "--only", "nothing-*", "--dry-run"])
    assert driver.main(["list"]) == 0
    assert "longest: The longest context" in capsys.readouterr().out


@pytest.mark.timeout(600)
def test_driver_runs_a_suite_within_its_budget(tmp_path):
    """A real run on CPU (gloo): train.py under torchrun (one process: the two-process runs of train.py are
    test_benchmarks_cpu's); its record stamped with suite, run and commit; a run needing flash-attention 4
    skipped by name; runs that do not fit the budget skipped."""
    import shutil

    if shutil.which("torchrun") is None:
        pytest.skip("no torchrun on PATH")
    cpu = ("--device", "cpu", "--warmup", "0", "--steps", "1", "--loss-chunk", "16")
    suite = Suite(name="cpu-smoke", question="", table="", runs={1: (
        Run(name="tiny-ours", kind="train", gpus=1, limit_s=400, system="seqpar", model="tiny", seq=64, args=cpu),
        Run(name="tiny-fa4", kind="train", gpus=1, limit_s=100, system="seqpar", model="tiny", seq=64, args=cpu, fa4=True))})
    lines: list[str] = []
    rows = driver.run_suite(suite, gpus=1, budget_s=500, out_dir=str(tmp_path), commit="feedbee", log=lines.append)
    text = "\n".join(lines)
    assert len(rows) == 1, text + open(tmp_path / "logs" / "cpu-smoke-tiny-ours.log").read()[-3000:]
    row = rows[0]
    assert (row["suite"], row["run"], row["commit"], row["model"], row["seq"], row["gpus"]) == ("cpu-smoke", "tiny-ours", "feedbee", "tiny", 64, 1)
    assert json.loads((tmp_path / "cpu-smoke.json").read_text()) == rows
    assert "tiny-fa4: SKIPPED (needs flash-attention 4" in text
    assert "== tiny-ours: rc=0" in text and "[train]" in (tmp_path / "cpu-smoke.log").read_text()
    lines.clear()
    assert driver.run_suite(suite, gpus=1, only=("tiny-ours",), budget_s=5, out_dir=str(tmp_path), commit="x", log=lines.append) == []
    # the budget left is whole seconds after the suite's start (5 on a quiet machine, less on a loaded one)
    assert any(re.search(r"tiny-ours: SKIPPED \([0-5]s of the budget left", x) for x in lines), lines


def test_fa4_install_needs_both_carried_folders(tmp_path, monkeypatch):
    """Note [Carrying flash-attention 4]: .whl2 without the first call's /tmp/whl says what to do."""
    monkeypatch.setattr(driver, "ROOT", str(tmp_path))
    monkeypatch.setattr(driver, "WHL", str(tmp_path / "whl"))
    (tmp_path / ".whl2").mkdir()
    (tmp_path / ".whl2" / "cu13part.ab").write_bytes(b"b")
    lines: list[str] = []
    driver.install_fa4(lines.append)
    assert "went cold; carry .whl again" in lines[0]
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "cu13part.aa").write_bytes(b"a")
    lines.clear()
    monkeypatch.setattr(driver.subprocess, "run", lambda *a, **k: argparse.Namespace(returncode=0, stderr=""))
    driver.install_fa4(lines.append)
    assert "copied .whl" in lines[0] and "installed into" in lines[1]
    assert (tmp_path / "whl" / driver.CU13).read_bytes() == b"ab"  # the split wheel joined in order


# ---- the generated docs ----------------------------------------------------------------------------

def _doc() -> str:
    return open(os.path.join(ROOT, "docs", "benchmarks.md")).read()


def _generated(doc: str) -> str:
    return "\n".join(re.findall(r"<!-- generated: [\w-]+ -->(.*?)<!-- end: [\w-]+ -->", doc, flags=re.S))


def test_docs_tables_match_the_records():
    doc = _doc()
    history = open(report.HISTORY_DOC).read()
    assert report.render(doc, report.records()) == doc, "run `python -m benchmarks tables`"
    assert report.render(history, report.records()) == history, "run `python -m benchmarks tables`"
    names = re.findall(r"<!-- generated: ([\w-]+) -->", doc + history)  # every table in one of the two, once
    assert sorted(names) == sorted(report.TABLES), names
    # a hand-edited figure is caught
    edited = doc.replace("3,271", "3,420", 1)
    assert edited != doc and report.render(edited, report.records()) == doc


def test_readme_figures_are_in_the_generated_tables():
    readme = open(os.path.join(ROOT, "README.md")).read()
    perf = readme.split("## Performance", 1)[1].split("\n## ", 1)[0]
    doc = _doc()
    tables = _generated(doc)
    figures = re.findall(r"\d[\d,]*\.\d+x?|\d{1,3}(?:,\d{3})+|\d+\.\d+x|\b\d+x\b", perf)
    assert len(figures) >= 15, figures
    missing = [x for x in figures if not re.search(r"(?<![\d.,])" + re.escape(x) + r"(?![\d,]|\.\d)", tables)]
    assert missing == [], f"README figures not in docs/benchmarks.md's generated tables: {missing}"
    # each README row's figures are in the rows of the docs table its link points to
    lines = doc.splitlines()
    rows = [r for r in perf.splitlines() if r.startswith("| [")]
    assert 3 <= len(rows) <= 5
    for row in rows:
        anchor = re.search(r"docs/benchmarks\.md#([\w-]+)", row)[1]
        start = next(i for i, x in enumerate(lines) if f'<a id="{anchor}">' in x)
        end = next((i for i in range(start + 1, len(lines)) if "<a id=" in lines[i] or not lines[i].startswith("|")), len(lines))
        group = "\n".join(lines[start:end])
        for x in re.findall(r"\d[\d,]*\.\d+x?|\d{1,3}(?:,\d{3})+|\b\d+x\b", row.split("](", 1)[1]):
            assert re.search(r"(?<![\d.,])" + re.escape(x) + r"(?![\d,]|\.\d)", group), (anchor, x)


def test_table_selection_rules():
    def rec(file, **kw):
        return {"bench": "train", "model": "llama-x", "seq": 1024, "gpus": 4, "_file": file, **kw}

    rows = [
        rec("20260101-k.json", system="seqpar", backend="fa4", tokens_per_s_per_gpu=900.0, commit="old"),
        rec("20260102-k.json", system="seqpar", backend="fa4", tokens_per_s_per_gpu=500.0, commit="new"),
        rec("20260102-k.json", system="seqpar", backend="fa4", tokens_per_s_per_gpu=600.0, commit="new"),
        rec("20260102-k.json", system="seqpar", backend="fa4", tokens_per_s_per_gpu=999.0, commit="new", tag="x-prof"),
        rec("20260102-k.json", system="seqpar", backend="fa4", tokens_per_s_per_gpu=998.0, commit="new", offload_params=True),
        rec("20260101-k.json", system="torch_cp", tokens_per_s_per_gpu=400.0, commit="old"),
        rec("20260103-k.json", system="torch_cp", tokens_per_s_per_gpu=480.0, commit="cp"),
    ]
    t = report.train_table(rows)
    assert "| 600 |" in t and "900" not in t and "999" not in t and "998" not in t  # the fastest of the last commit
    assert "| 1.25x* |" in t and "new, 2026-01-02" in t and "cp, 2026-01-03" in t  # 600 / 480, of another commit: "*"
    same = report.train_table(rows + [rec("20260103-k.json", system="tp_sp", tokens_per_s_per_gpu=300.0, commit="new")])
    assert "| 1.25x* | 2.00x |" in same  # 600 / 300 in the same session: no mark
    longest = [
        {"bench": "longest", "system": "seqpar", "model": "m", "gpus": 2, "seq": 4096, "_file": "20260101-k.json",
         "attempts": [{"seq": 4096, "status": "ok"}]},
        {"bench": "longest", "system": "seqpar", "model": "m", "gpus": 2, "seq": None, "_file": "20260102-k.json",
         "attempts": [{"seq": 8192, "status": "oom"}]},
        {"bench": "longest", "system": "torch_cp", "model": "m", "gpus": 2, "seq": 1024, "_file": "20260101-k.json",
         "attempts": [{"seq": 1024, "status": "ok"}]},
    ]
    t = report.longest_table(longest)
    assert "**4,096**" in t and "| 4.00x |" in t  # a later OOM at a longer S does not hide what trained


def test_host_memory_watchdog_fires_once_and_writes_the_error_row(tmp_path, capsys):
    """Note [The host-memory watchdog]: with MemAvailable under the floor (min(8 GB, 3% of MemTotal)) the watchdog calls
    its callback once with the host-out-of-memory line; host_oom_exit appends the row as an error row, says it and ends
    the process with HOST_OOM_EXIT (here a fake end); without /proc/meminfo nothing runs."""
    readings = iter([{"MemTotal": 270e9, "MemAvailable": 100e9}, {"MemTotal": 270e9, "MemAvailable": 9e9}])
    low = {"MemTotal": 270e9, "MemAvailable": 5e9}
    fired: list[str] = []
    with driver.HostMemoryWatchdog(fired.append, interval_s=0.01, read=lambda: next(readings, low)) as watchdog:
        for _ in range(200):
            if fired:
                break
            driver.time.sleep(0.01)
    assert len(fired) == 1 and watchdog.fired == fired[0], fired
    assert re.fullmatch(r"host out of memory: MemAvailable 5\.0 GB of 270\.0 GB at process RSS \d+\.\d GB \(peak RSS \d+\.\d GB\)",
                        fired[0]), fired
    small = driver.HostMemoryWatchdog(fired.append, read=lambda: {"MemTotal": 100e9, "MemAvailable": 3.5e9})
    assert small.check() is None and small.floor_gb == 8.0  # 3% of 100 GB: 3 GB is the floor there
    with driver.HostMemoryWatchdog(fired.append, read=lambda: None) as absent:
        assert absent._thread is None  # no /proc/meminfo: a no-op
    out, ended = tmp_path / "rows.json", []
    row = {"bench": "alst", "system": "alst", "model": "m", "seq": 262144, "gpus": 1}
    on_low = driver.host_oom_exit(row, str(out), say=lambda r: print("[alst]", r["error"]), end=ended.append)
    on_low(fired[0])
    written = json.load(open(out))
    assert driver.HOST_OOM_EXIT == 4 and ended == [4] and len(written) == 1
    assert written[0]["error"] == fired[0] and written[0]["host_oom"] is True and written[0]["host_maxrss_gb"] > 0
    assert report.problems(written[0]) == [] and fired[0] in capsys.readouterr().out


def test_host_memory_watchdog_ends_the_process_with_its_exit_code(tmp_path):
    """The real end: os._exit(HOST_OOM_EXIT) from the watchdog's thread while the main thread runs, the row written."""
    import subprocess

    out = tmp_path / "rows.json"
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import driver; "
            "row = dict(bench='memory_plan', system='seqpar', model='m', seq=8, gpus=1); "
            "on_low = driver.host_oom_exit(row, sys.argv[2], say=lambda r: print('[hf]', r['error'])); "
            "w = driver.HostMemoryWatchdog(on_low, interval_s=0.01, read=lambda: dict(MemTotal=64e9, MemAvailable=1e9))\n"
            "with w: time.sleep(30)\nprint('not ended')")
    done = subprocess.run([sys.executable, "-c", code, BENCHMARKS, str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == driver.HOST_OOM_EXIT, done.stdout + done.stderr
    assert "[hf] host out of memory: MemAvailable 1.0 GB of 64.0 GB" in done.stdout and "not ended" not in done.stdout
    assert json.load(open(out))[0]["host_oom"] is True
