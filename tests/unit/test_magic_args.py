"""``%wb``'s arguments: one table, the parser made from it, and ``%wb help`` written from that parser."""

import argparse

import pytest
from IPython.core.error import UsageError

from workbench.magic_args import COMMANDS, SUBCOMMANDS, help_text, launcher_options, parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    (commands,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_help_lists_every_subcommand_and_every_flag_the_parser_takes():
    text = help_text()
    subs = _subparsers()
    assert set(subs) == set(SUBCOMMANDS) and len(SUBCOMMANDS) == len(COMMANDS) >= 14
    for name, sub in subs.items():
        assert sub.prog in text, name
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in text, f"%wb help does not list {sub.prog} {flag}"
            if not action.option_strings:
                assert action.metavar in text, f"%wb help does not show {sub.prog}'s {action.dest}"
    assert max(len(line) for line in text.splitlines()) <= 112  # reads in a notebook without scrolling


def test_start_takes_a_batch_sites_options_by_name_and_any_launcher_option():
    args = parser().parse_args(["start", "--engines", "slurm", "--controller-ip", "10.0.0.5", "--queue", "gpu",
                                "--account", "proj42", "--timelimit", "01:00:00", "--option", "hosts={'node1': 2}",
                                "--option", "ssh_args=['-i', 'key']", "--option", "remote_python=/opt/venv/bin/python"])
    assert (args.engines, args.controller_ip, args.queue, args.account, args.timelimit) == (
        "slurm", "10.0.0.5", "gpu", "proj42", "01:00:00")
    assert launcher_options(args.option) == {"hosts": {"node1": 2}, "ssh_args": ["-i", "key"],
                                             "remote_python": "/opt/venv/bin/python"}


@pytest.mark.parametrize("pair", ["hosts", "=2", "two words=1"])
def test_an_option_that_is_not_key_equals_value_says_how_to_write_it(pair):
    with pytest.raises(UsageError, match="--option: launcher option .*write KEY=VALUE"):
        launcher_options([pair])


def test_a_bad_flag_says_where_to_look():
    with pytest.raises(UsageError, match="unrecognized arguments: --partition.*%wb help"):
        parser().parse_args(["start", "--partition", "gpu"])
