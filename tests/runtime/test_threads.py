"""EngineConfig.num_threads / --threads: the default (the physical cores of the affinity mask,
within the cgroup CPU quota, read from fake sysfs and cgroup files here), and the option reaching
torch's thread count from every command, put back when the engine shuts down."""
import pytest
import torch

from pagedecode.runtime import threads
from pagedecode.runtime.config import EngineConfig
from pagedecode.runtime.threads import cgroup_cpu_limit, default_num_threads, physical_cores


def fake_topology(root, cores):
    """cores: per logical CPU, its (package, core)."""
    for cpu, (package, core) in enumerate(cores):
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def fake_cgroup(root, cpu_max=None, self_line="0::/\n", nested=None):
    root.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (root / "cpu.max").write_text(cpu_max + "\n")
    if nested is not None:
        path, limit = nested
        (root / path).mkdir(parents=True)
        (root / path / "cpu.max").write_text(limit + "\n")
    proc = root.parent / "proc-self-cgroup"
    proc.write_text(self_line)
    return root, proc


def test_hyperthreads_of_one_core_count_once(tmp_path):
    sys_cpu = fake_topology(tmp_path / "cpu", [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 0)])
    assert physical_cores({0, 1, 2, 3, 4, 5}, sys_cpu) == 3
    assert physical_cores({0, 2}, sys_cpu) == 1            # an affinity mask of one core's two threads
    assert physical_cores({0, 1, 7}, sys_cpu) == 3         # no topology for cpu7: count logical CPUs


@pytest.mark.parametrize("cpu_max, want", [("max 100000", None), ("150000 100000", 1.5), ("50000 100000", 0.5),
                                           ("400000 100000", 4.0)])
def test_cgroup_v2_quota(tmp_path, cpu_max, want):
    root, proc = fake_cgroup(tmp_path / "cg", cpu_max)
    assert cgroup_cpu_limit(root, proc) == want


def test_the_tightest_quota_of_the_process_cgroup_and_its_parents(tmp_path):
    root, proc = fake_cgroup(tmp_path / "cg", "300000 100000", self_line="0::/app.slice/job\n",
                             nested=("app.slice/job", "200000 100000"))
    assert cgroup_cpu_limit(root, proc) == 2.0


def test_cgroup_v1_quota(tmp_path):
    root = tmp_path / "cg"
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc"
    proc.write_text("2:cpuacct:/\n1:cpu:/\n0::/\n")
    assert cgroup_cpu_limit(root, proc) == 2.5
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(root, proc) is None


@pytest.mark.parametrize("cpu_max, affinity, want", [
    ("max 100000", {0, 1, 2, 3, 4, 5, 6, 7}, 4),      # 8 hyperthreads on 4 cores
    ("max 100000", {0, 1}, 2),                         # taskset -c 0,1 (two cores)
    ("250000 100000", set(range(8)), 2),               # docker --cpus 2.5: rounded down
    ("50000 100000", set(range(8)), 1),                # half a CPU: still one thread
])
def test_default_num_threads(tmp_path, monkeypatch, cpu_max, affinity, want):
    sys_cpu = fake_topology(tmp_path / "cpu", [(0, c % 4) for c in range(8)])
    root, proc = fake_cgroup(tmp_path / "cg", cpu_max)
    monkeypatch.setattr(threads, "allowed_cpus", lambda: affinity)
    assert default_num_threads(root, proc, sys_cpu) == want


def test_num_threads_is_checked():
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        EngineConfig(num_threads=0)
    assert EngineConfig(num_threads=3).threads() == 3


def test_the_engine_sets_the_thread_count_and_puts_it_back(stories_engine_factory):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        engine = stories_engine_factory(num_threads=1)
        assert torch.get_num_threads() == 1 and engine.num_threads == 1
        engine.generate(["Once upon a time"], __import__("pagedecode").SamplingParams(max_tokens=4))
        engine.shutdown()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_default_engine_takes_the_default_count(stories_engine_factory, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr("pagedecode.runtime.config.default_num_threads", lambda: 1)
    try:
        engine = stories_engine_factory()
        assert engine.num_threads == 1 and torch.get_num_threads() == 1
        engine.shutdown()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["generate", "demo", "chat", "serve"])
def test_every_command_takes_threads(command, monkeypatch):
    from pagedecode import cli
    from pagedecode.server.flags import engine_options
    args = cli.build_parser().parse_args([command, "--threads", "3"] + (["--prompt", "x"] if command == "generate"
                                                                        else []))
    assert args.threads == 3
    if command == "serve":
        assert engine_options(args)["num_threads"] == 3
        assert "num_threads" not in engine_options(cli.build_parser().parse_args(["serve"]))
    else:
        made = {}
        import pagedecode as pd
        monkeypatch.setattr(pd.Engine, "from_pretrained", classmethod(lambda cls, *a, **k: made.update(k)))
        cli._engine(args)
        assert made["num_threads"] == 3


def test_a_tensor_parallel_rank_leaves_the_other_ranks_their_cores(stories_engine_factory, monkeypatch):
    """The worker ranks run one thread each: rank 0's default is the rest of the cores."""
    before = torch.get_num_threads()
    monkeypatch.setattr("pagedecode.runtime.config.default_num_threads", lambda: 4)
    try:
        engine = stories_engine_factory()
        model = engine.model
        monkeypatch.setattr(model, "world", 3, raising=False)
        again = __import__("pagedecode").Engine(model, engine.tokenizer)
        assert (engine.num_threads, again.num_threads) == (4, 2)
        assert __import__("pagedecode").Engine(model, engine.tokenizer,
                                               EngineConfig(num_threads=3)).num_threads == 3   # as given
    finally:
        torch.set_num_threads(before)
