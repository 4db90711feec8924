"""Fleet files: what each replica asks Ray for and which ``podium serve`` it runs; mistakes named."""

from __future__ import annotations

import pytest

from podium_router.fleet import FleetSpec
from podium_router.settings import read_replica_file

FLEET = """
[ray]
address = "auto"

[[replica]]
name = "h200"
model = "some/model"
platform = "cuda"
num_gpus = 1
replicas = 2
args = ["--max-num-seqs", "128"]

[[replica]]
model = "some/model"
platform = "my-npu"
num_cpus = 4
resources = { NPU = 1 }
env = { OMP_NUM_THREADS = "4" }
max_restarts = 3
"""


def test_a_fleet_file_becomes_one_plan_per_replica(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    spec = FleetSpec.read(path)
    assert spec.address == "auto"
    assert [p.name for p in spec.replicas] == ["h200-0", "h200-1", "replica1"]
    gpu, npu = spec.replicas[0], spec.replicas[2]
    assert gpu.actor_options() == {"max_restarts": -1, "max_task_retries": 0, "num_cpus": 1.0, "num_gpus": 1}
    assert npu.actor_options()["resources"] == {"NPU": 1} and npu.actor_options()["max_restarts"] == 3
    command = gpu.serve_command("10.0.0.2", 9000)
    assert command[1:] == ["serve", "some/model", "--host", "10.0.0.2", "--port", "9000", "--device", "cuda",
                           "--max-num-seqs", "128"]
    assert npu.env == {"OMP_NUM_THREADS": "4"}


@pytest.mark.parametrize("text, message", [
    ("[ray]\n", "name at least one replica"),
    ('[[replica]]\nname = "a"\n', "names no model"),
    ('[[replica]]\nmodel = "m"\nnum_gpu = 1\n', "unknown keys \\['num_gpu'\\]"),
    ('[[replica]]\nmodel = "m"\nname = "a"\n[[replica]]\nmodel = "m"\nname = "a"\n', "must be unique"),
    ("[[replica]\n", "fleet file"),
])
def test_fleet_file_mistakes_are_named(tmp_path, text, message):
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        FleetSpec.read(path)


def test_replica_files_in_each_format(tmp_path):
    plain = tmp_path / "replicas.txt"
    plain.write_text("# the fleet\nhttp://a:8000 gpu-a\n\nhttp://b:8000  # no name\n")
    assert [(s.url, s.name) for s in read_replica_file(plain)] == [("http://a:8000", "gpu-a"), ("http://b:8000", "")]
    toml = tmp_path / "replicas.toml"
    toml.write_text('replicas = [{url = "http://a:8000", name = "a"}, "http://b:8000"]\n')
    assert [s.url for s in read_replica_file(toml)] == ["http://a:8000", "http://b:8000"]
    bad = tmp_path / "bad.txt"
    bad.write_text("http://a:8000\nftp://nope\n")
    with pytest.raises(ValueError, match="bad.txt:2: replica URL must start with http"):
        read_replica_file(bad)
