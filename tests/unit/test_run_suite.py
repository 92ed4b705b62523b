"""What ``make test`` runs (tests/run_suite.py): its parts' selections, and each part's CPU report when its
tests are spread over pytest-xdist workers (tests/cpu_accounting.py)."""

import cpu_accounting
import run_suite


def test_the_core_half_runs_on_xdist_workers_that_take_whole_files():
    parts = run_suite.halves()
    assert parts["environment"] == run_suite.ENVIRONMENT  # its tests share the machine's environment: one process
    core = parts["core"]
    assert core[core.index("-n") + 1] == str(run_suite.CORE_WORKERS) and core[core.index("--dist") + 1] == "loadfile"
    assert all(f"--ignore={path}" in core for path in [*run_suite.ENVIRONMENT, *run_suite.QUIET])


def test_the_workers_reports_are_joined_into_the_parts_and_their_cgroups_removed(tmp_path):
    report = tmp_path / "cpu-core.tsv"
    cgroup = tmp_path / "cgroup"
    for worker, rows in (("gw0", [("tests/a.py::one", 2.0, 1.5), ("tests/b.py::two", 1.0, 0.5)]),
                         ("gw1", [("tests/a.py::three", 4.0, 3.0)])):
        (cgroup / worker).mkdir(parents=True)
        part = cpu_accounting._Accounts(cgroup / worker, cpu_accounting._worker_report(report, worker))
        part.rows.extend(rows)
        part.write()
    cpu_accounting._join_workers(report, cgroup)
    lines = report.read_text().splitlines()
    assert cpu_accounting._rows(report) == [("tests/a.py::one", 2.0, 1.5), ("tests/b.py::two", 1.0, 0.5),
                                            ("tests/a.py::three", 4.0, 3.0)]
    files = lines[lines.index("file\twall_s\tcpu_s") + 1:]
    assert files == ["tests/a.py\t6.0\t4.5", "tests/b.py\t1.0\t0.5"]  # costliest first, both workers' tests
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cgroup", "cpu-core.tsv"]  # the workers' files joined
    assert not list(cgroup.iterdir())  # their cgroups gone


def test_a_part_without_workers_keeps_its_own_report(tmp_path):
    report, cgroup = tmp_path / "cpu-environment.tsv", tmp_path / "cgroup"
    cgroup.mkdir()
    own = cpu_accounting._Accounts(cgroup, report)
    own.rows.append(("tests/c.py::one", 1.0, 1.0))
    own.write()
    cpu_accounting._join_workers(report, cgroup)
    assert cpu_accounting._rows(report) == [("tests/c.py::one", 1.0, 1.0)]
