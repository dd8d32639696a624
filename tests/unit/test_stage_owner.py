"""``--stage-owner``: which uids may serve a stage, as Admission judges it and as the
settings read it from flags, the environment and the config file."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from relayd import config
from relayd.rpc.admission import Admission

DAEMON_UID, LISTED, OTHER = 990, 1001, 1002
EXPECTED = (("talker", (1001, 1002)), ("thinker", (1003,)))


def test_a_listed_stage_is_served_only_by_its_uids_root_and_the_daemons_uid() -> None:
    a = Admission([], [DAEMON_UID], daemon_uid=DAEMON_UID, stage_owners={"talker": [LISTED]})
    assert a.stage_refused(["talker"], LISTED) is None
    assert a.stage_refused(["talker"], OTHER) == "talker"
    # One refused stage refuses the session, whatever else it declares.
    assert a.stage_refused(["thinker", "talker"], OTHER) == "talker"
    # A stage without a list stays open to every admitted uid.
    assert a.stage_refused(["thinker"], OTHER) is None
    # Root and the daemon's own uid can take over the daemon anyway (ptrace, the
    # segments by name): refusing them a stage would protect nothing.
    assert a.stage_refused(["talker"], 0) is None
    assert a.stage_refused(["talker"], DAEMON_UID) is None


def test_without_lists_every_stage_is_open() -> None:
    a = Admission([], [DAEMON_UID], daemon_uid=DAEMON_UID)
    assert a.stage_refused(["talker", "thinker"], OTHER) is None


def test_the_flag_repeats_and_merges_one_stages_uids() -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(
        ["--stage-owner", "talker=1001", "--stage-owner", "thinker=1003",
         "--stage-owner", "talker=1002"]
    )  # fmt: skip
    assert config.load(vars(args), environ={}).stage_owner == EXPECTED


def test_the_environment_separates_stages_with_semicolons() -> None:
    env = {"RELAYD_STAGE_OWNER": "talker=1001,1002; thinker=1003"}
    assert config.load(environ=env).stage_owner == EXPECTED


@pytest.mark.parametrize(
    "toml",
    [
        "[relayd.stage_owner]\ntalker = [1001, 1002]\nthinker = 1003\n",
        'stage_owner = ["talker=1001,1002", "thinker=1003"]\n',
        'stage_owner = "talker=1001,1002;thinker=1003"\n',
    ],
    ids=["table", "list", "string"],
)
def test_the_config_file_takes_a_table_or_a_list(tmp_path: pathlib.Path, toml: str) -> None:
    path = tmp_path / "relayd.toml"
    path.write_text(toml)
    assert config.load(config_file=str(path), environ={}).stage_owner == EXPECTED


def test_unset_means_no_list() -> None:
    assert config.load(environ={}).stage_owner == ()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("talker=abc", "uid 'abc' of stage 'talker' is not an integer"),
        ("=1001", "stage_owner: stage name '' must be"),
        ("bad name=1001", "stage_owner: stage name 'bad name' must be"),
        ("talker", "'talker' is not STAGE=UID[,UID...]"),
        ("talker=", "'talker' names no uid"),
        ("talker=-1", "uid -1 of stage 'talker' is not a uid"),
        ("relayd-cli=0", "relayd-cli is the CLI's own stage"),
    ],
)
def test_bad_values_are_one_line_config_errors(value: str, says: str) -> None:
    with pytest.raises(config.ConfigError) as exc:
        config.load({"stage_owner": [value]}, environ={})
    assert says in str(exc.value)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ('[stage_owner]\ntalker = ["x"]\n', "uid 'x' of stage 'talker' is not an integer"),
        ("[stage_owner]\ntalker = true\n", "uid True of stage 'talker' is not an integer"),
        ("[stage_owner]\ntalker = []\n", "'talker' names no uid"),
        ("stage_owner = [1001]\n", "1001 is not STAGE=UID[,UID...]"),
    ],
)
def test_bad_config_file_values_are_config_errors(
    tmp_path: pathlib.Path, toml: str, says: str
) -> None:
    path = tmp_path / "relayd.toml"
    path.write_text(toml)
    with pytest.raises(config.ConfigError, match="stage_owner") as exc:
        config.load(config_file=str(path), environ={})
    assert says in str(exc.value)
