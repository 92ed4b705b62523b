"""Rates, delays and link selection of cluster.shape(...) (pure: no process started)."""

import pytest

from workbench.cluster.network import netns
from workbench.cluster.network.netns import tc_plan
from workbench.cluster.network.shaping import Rule, Shaping, choose_backend, parse_delay, parse_rate, select_links
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


@pytest.fixture
def netns_can(monkeypatch):
    """Set what this process found about the netns backend: ``netns_can(problem, netem_problem)``."""
    def set_to(problem: str = "", netem: str = "") -> None:
        monkeypatch.setattr(netns, "_CACHE", {"problem": problem, "netem": netem})
    return set_to


def test_network_option(netns_can):
    netns_can("it needs root")
    assert choose_backend("auto") == ("user", None, None)
    backend, rule, mtu = choose_backend("1gbit")
    assert backend == "user" and rule.rate == 1e9 and rule.between == "all" and mtu is None
    backend, rule, _ = choose_backend({"rate": "100mbit", "delay": "1ms", "between": "ps"})
    assert (rule.rate, rule.delay, rule.between) == (1e8, 1e-3, "ps")
    with pytest.raises(ConfigurationError, match=r"'netns' cannot run here: it needs root\. Use backend 'user'"):
        choose_backend("netns")
    with pytest.raises(ConfigurationError, match="unknown key"):
        choose_backend({"speed": "1gbit"})
    with pytest.raises(ConfigurationError, match=r"network='fast': use 'auto'"):
        choose_backend("fast")
    with pytest.raises(ConfigurationError, match=r"backend 'tunnel' is unknown: use 'auto', 'netns' or 'user'"):
        choose_backend({"backend": "tunnel"})


def test_auto_picks_netns_where_it_runs_unless_the_first_rule_needs_a_missing_delay(netns_can):
    netns_can("", "no netem")
    assert choose_backend("auto") == ("netns", None, None)
    assert choose_backend("1gbit")[0] == "netns"
    assert choose_backend({"rate": "1gbit", "delay": "1ms"})[0] == "user"  # the relay adds delay itself
    assert choose_backend({"rate": "1gbit", "delay": "1ms", "backend": "netns"})[0] == "netns"  # asked: said at shape
    netns_can("", "")
    assert choose_backend({"rate": "1gbit", "delay": "1ms"})[0] == "netns"


def test_an_mtu_is_for_netns_links_and_a_frame_size(netns_can):
    netns_can("", "no netem")
    assert choose_backend({"rate": "1gbit", "mtu": 9000}) == ("netns", Rule("all", 1e9, 0.0), 9000)
    assert choose_backend({"mtu": 1500, "backend": "netns"}) == ("netns", None, 1500)
    for bad in (9000.0, "9000", 67, 65536, True):
        with pytest.raises(ConfigurationError, match=r"is not a frame size: .* from 68 to 65535 .*9000 jumbo frames"):
            choose_backend({"mtu": bad})
    with pytest.raises(ConfigurationError, match=r"mtu=9000 needs the netns links .*backend 'user' was asked for"):
        choose_backend({"mtu": 9000, "backend": "user"})
    with pytest.raises(ConfigurationError, match=r"first rule's delay needs the user-space relay here \(no netem\)"):
        choose_backend({"rate": "1gbit", "delay": "1ms", "mtu": 9000})
    netns_can("it needs root")
    with pytest.raises(ConfigurationError, match=r"netns links cannot run here \(it needs root\).*Leave mtu out"):
        choose_backend({"mtu": 9000})


ADDRESSES = {"ps:0": "10.213.0.2", "worker:0": "10.213.0.3", "worker:1": "10.213.0.4"}
PORTS = {"ps:0": "t0", "worker:0": "t1", "worker:1": "t2"}


def filters(lines: list[str]) -> dict[str, str]:
    """Peer address -> class, from a direction's filter lines."""
    return {line.split(" match ip ")[1].split()[1].split("/")[0]: line.rsplit(" ", 1)[1]
            for line in lines if line.startswith("filter")}


def test_tc_shapes_both_directions_of_a_task_and_leaves_the_kernel_out():
    settings, pairs = Shaping([Rule("all", 1e9, 0.0)]).plan(list(ADDRESSES))
    plan = tc_plan(ADDRESSES, PORTS, settings, pairs)
    out, into = plan["ps:0"]["out"], plan["ps:0"]["in"]
    assert out[0] == "qdisc add dev eth0 root handle 1: htb default 0"  # unclassified (the kernel's): not shaped
    assert into[0] == "qdisc add dev t0 root handle 1: htb default 0"
    assert "classid 1:1 htb rate 1000000000bit ceil 1000000000bit burst 500000 " in out[1]
    assert filters(out) == {"10.213.0.3": "1:1", "10.213.0.4": "1:1"}
    assert all(" match ip dst " in line for line in out if line.startswith("filter"))
    assert filters(into) == {"10.213.0.3": "1:1", "10.213.0.4": "1:1"}
    assert all(" match ip src " in line for line in into if line.startswith("filter"))
    assert not any("netem" in line for line in out + into)


def test_tc_between_two_jobs_counts_but_does_not_shape_the_rest():
    settings, pairs = Shaping([Rule("ps-worker", 1e8, 0.0)]).plan(list(ADDRESSES))
    plan = tc_plan(ADDRESSES, PORTS, settings, pairs)
    assert filters(plan["ps:0"]["out"]) == {"10.213.0.3": "1:1", "10.213.0.4": "1:1"}
    assert filters(plan["worker:0"]["out"]) == {"10.213.0.2": "1:1", "10.213.0.4": "1:2"}  # worker to worker: free
    assert "classid 1:2 htb rate 100gbit" in plan["worker:0"]["out"][2]
    unshaped = tc_plan(ADDRESSES, PORTS, {}, [])
    assert set(filters(unshaped["worker:1"]["in"]).values()) == {"1:2"}


def test_tc_delay_is_the_larger_of_the_two_tasks_and_sits_on_the_sending_side():
    settings, pairs = Shaping([Rule("all", None, 1e-3), Rule("worker:1", 1e8, 5e-3)]).plan(list(ADDRESSES))
    plan = tc_plan(ADDRESSES, PORTS, settings, pairs)
    out = plan["ps:0"]["out"]
    assert "classid 1:1 htb rate 100gbit" in out[1]  # a delay alone does not limit the rate
    netem = {line.split(" parent ")[1].split()[0]: line.split(" delay ")[1].split()[0] for line in out if "netem" in line}
    assert netem == {"1:10": "1000us", "1:11": "5000us"}
    assert filters(out) == {"10.213.0.3": "1:10", "10.213.0.4": "1:11"}
    assert not any("netem" in line for line in plan["worker:1"]["in"])
    assert "rate 100000000bit" in plan["worker:1"]["in"][1]
