"""What torchrun is asked to start, from a profile's [run] section, and how bad values are reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuopt_tui.core.errors import ProfileError
from gpuopt_tui.core.profiles.io import profile_from_data
from gpuopt_tui.core.runs.distributed import Scale, parse_devices, scale_of, torchrun_command, torchrun_env


def attribution(**run: object) -> object:
    return profile_from_data({"kind": "attribution", "run": run}, "p.toml")


@pytest.mark.parametrize(
    ("devices", "expected"),
    [("1", ("1", "")), ("4", ("4", "")), ("all", ("gpu", "")), ("ALL", ("gpu", "")), ("0,2", ("2", "0,2"))],
)
def test_devices_values(devices: str, expected: tuple[str, str]) -> None:
    assert parse_devices(devices) == expected


def test_devices_as_a_toml_integer_is_a_count() -> None:
    profile = attribution(devices=2, device="cpu")
    assert profile.run.devices == "2" and scale_of(profile.run) == Scale("2", "", 1, "")


@pytest.mark.parametrize(
    ("run", "key", "words"),
    [
        ({"devices": "0,0"}, "run.devices", "names a GPU twice"),
        ({"devices": "two"}, "run.devices", 'expected a count such as 2, "all"'),
        ({"devices": 0}, "run.devices", "expected a count"),
        ({"devices": "all", "device": "cpu"}, "run.devices", "CPU processes"),
        ({"devices": 2, "device": "cuda:1"}, "run.device", "picks one GPU"),
        ({"nodes": 2}, "run.rendezvous", 'needs rendezvous = "host:port"'),
        ({"nodes": 2, "rendezvous": "node1"}, "run.rendezvous", "host:port"),
    ],
)
def test_bad_scale_names_the_key(run: dict[str, object], key: str, words: str) -> None:
    with pytest.raises(ProfileError) as info:
        attribution(**run)
    assert info.value.key == key and words in str(info.value)


def test_one_node_uses_a_standalone_rendezvous() -> None:
    cmd = torchrun_command(Path("/runs/r1"), Scale("2"), python="py")
    assert cmd == ["py", "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                   "-m", "gpuopt_tui.jobs.worker", "/runs/r1"]  # fmt: skip


def test_several_nodes_meet_at_the_rendezvous_named_by_the_run() -> None:
    scale = scale_of(attribution(devices="0,2", nodes=2, rendezvous="node1:29500").run)
    cmd = torchrun_command(Path("/runs/r1"), scale, python="py")
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--rdzv-endpoint") + 1] == "node1:29500"
    assert cmd[cmd.index("--rdzv-id") + 1] == "r1" and "--standalone" not in cmd
    assert torchrun_env(scale, {})["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert scale.distributed and "x 2 nodes" in scale.describe()


def test_the_plan_kind_runs_in_one_process() -> None:
    profile = profile_from_data({"kind": "plan"}, "p.toml")
    assert not hasattr(profile.run, "devices") and not scale_of(profile.run).distributed
