"""tests/cpu_times.py: the slowest tests by CPU time, their children's counted, with and without pytest-xdist."""

import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent

TESTS = '''
import subprocess, sys, time

def spin(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass

def test_spins_itself():
    spin(0.6)

def test_waits_for_a_spinning_child():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.2: pass"], check=True)

def test_sleeps():
    time.sleep(0.8)
'''


def _run(tmp_path, *args):
    (tmp_path / "test_three.py").write_text(TESTS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "cpu_times", "-p", "no:cacheprovider", "-q", *args, str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(HERE), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def _listed(out):
    """The CPU list's rows: [(cpu, sys, wall, test name)], and its total line's cpu."""
    section = out.split("by CPU time (user + sys, with the processes each test waited for)")[1]
    rows = re.findall(r"^ *([\d.]+)s cpu \(sys +([\d.]+)s\) +([\d.]+)s wall  \S+::(\w+)$", section, flags=re.M)
    total = re.search(r"^every test: (\d+) s cpu \((\d+) s user, (\d+) s sys\) in 3 tests$", section, flags=re.M)
    return [(float(c), float(s), float(w), name) for c, s, w, name in rows], total


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_the_slowest_by_cpu_count_the_children_and_not_the_sleep(tmp_path, workers):
    out = _run(tmp_path, "--durations=3", *workers)
    rows, total = _listed(out)
    assert [name for *_, name in rows] == ["test_waits_for_a_spinning_child", "test_spins_itself", "test_sleeps"], out
    (child, _, _, _), (own, _, _, _), (sleep, _, sleep_wall, _) = rows
    assert 1.2 <= child < 3.0 and 0.6 <= own < 1.0 and sleep < 0.2 <= 0.8 <= sleep_wall, rows  # a child's interpreter start on top
    # the total, whole seconds of the unrounded times, is within its rounding of the rows' (each to 0.01 s) sum
    assert total and abs(int(total[1]) - sum(c for c, *_ in rows)) <= 0.52 and out.index("slowest 3 durations") < out.index("by CPU time")


def test_the_costliest_files_sum_their_tests(tmp_path):
    (tmp_path / "test_one.py").write_text("import time\n\ndef test_spin():\n    t = time.process_time()\n"
                                          "    while time.process_time() - t < 0.3: pass\n")
    out = _run(tmp_path, "--durations=2")
    section = out.split("costliest 2 test files by CPU time (their tests' together)")[1]
    rows = re.findall(r"^ *([\d.]+)s cpu +(\d+) tests  (\S+)$", section, flags=re.M)
    assert [(count, path) for _, count, path in rows] == [("3", "test_three.py"), ("1", "test_one.py")], out
    (three, _, _), (one, _, _) = rows
    assert 1.8 <= float(three) < 4.5 and 0.3 <= float(one) < 0.6, rows


def test_durations_choose_how_many_and_none_prints_nothing(tmp_path):
    rows, _ = _listed(_run(tmp_path, "--durations=1"))
    assert [name for *_, name in rows] == ["test_waits_for_a_spinning_child"]
    assert len(_listed(_run(tmp_path, "--durations=0"))[0]) == 3
    assert "by CPU time" not in _run(tmp_path)
