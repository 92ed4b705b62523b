"""Rates, delays and link selection of cluster.shape(...) (pure: no process started)."""

import pytest

from workbench.cluster.shaping import Rule, Shaping, choose_backend, parse_delay, parse_rate, select_links
from workbench.errors import ConfigurationError

TASKS = ["ps:0", "worker:0", "worker:1"]


@pytest.mark.parametrize("text, bits", [("1gbit", 1e9), ("100mbit", 1e8), ("500kbit", 5e5), ("10Gbit", 1e10),
                                        ("125mbps", 1e9), ("2.5gbit", 2.5e9), (1e6, 1e6)])
def test_rates_are_written_as_tc_writes_them(text, bits):
    assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize("text, seconds", [("0.2ms", 2e-4), ("200us", 2e-4), ("1s", 1.0), (0.01, 0.01), (None, 0.0)])
def test_delays(text, seconds):
    assert parse_delay(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["fast", "1gigabit", "-1mbit", 0, "0mbit", True])
def test_a_bad_rate_says_how_to_write_one(bad):
    with pytest.raises(ConfigurationError, match="'1gbit', '100mbit'"):
        parse_rate(bad)


def test_a_bad_delay_says_how_to_write_one():
    with pytest.raises(ConfigurationError, match="'0.2ms'"):
        parse_delay("soon")


def test_all_links_shape_every_pair():
    ends, pairs = select_links("all", TASKS)
    assert ends == TASKS and len(pairs) == 3


def test_two_jobs_shape_only_the_traffic_between_them():
    ends, pairs = select_links("ps-worker", TASKS)
    assert ends == TASKS
    assert pairs == {frozenset(("ps:0", "worker:0")), frozenset(("ps:0", "worker:1"))}


def test_one_task_shapes_its_own_link():
    ends, pairs = select_links("worker:1", TASKS)
    assert ends == ["worker:1"]
    assert pairs == {frozenset(("worker:1", "ps:0")), frozenset(("worker:1", "worker:0"))}


def test_an_unknown_task_or_job_names_the_choices():
    with pytest.raises(ConfigurationError, match=r"neither a task nor a job.*ps-worker"):
        select_links("chief", TASKS)


def test_a_later_rule_overrides_an_earlier_one_and_rates_go_out_in_bytes():
    shaping = Shaping([Rule("all", 1e9, 0.0), Rule("worker:1", 1e8, 2e-3)])
    settings, pairs = shaping.plan(TASKS)
    assert settings["ps:0"] == {"rate": 1.25e8, "delay": 0.0}
    assert settings["worker:1"] == {"rate": 1.25e7, "delay": 2e-3}
    assert "worker:1: 100 Mbit/s, delay 2 ms" in shaping.describe()


def test_network_option():
    assert choose_backend("auto") == ("user", None)
    backend, rule = choose_backend("1gbit")
    assert backend == "user" and rule.rate == 1e9 and rule.between == "all"
    backend, rule = choose_backend({"rate": "100mbit", "delay": "1ms", "between": "ps"})
    assert (rule.rate, rule.delay, rule.between) == (1e8, 1e-3, "ps")
    with pytest.raises(ConfigurationError, match="not available in this version"):
        choose_backend("netns")
    with pytest.raises(ConfigurationError, match="unknown key"):
        choose_backend({"speed": "1gbit"})
    with pytest.raises(ConfigurationError, match=r"network='fast': use 'auto'"):
        choose_backend("fast")
