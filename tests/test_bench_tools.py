"""The bench's analysis tools on synthetic step logs whose answer is known."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY = os.path.join(ROOT, "examples", "partial_study")  # the partial-rollout study


def write_run(path, step_times, reward=0.5, accuracy=(0.5, 0.6, 0.7), **metrics):
    """A run's metrics.jsonl: a step a step time; the reward (one, or one a step); held-out evaluations at
    step 0, the middle step and the last (accuracy); metrics: a course per step of other metrics."""
    evals = dict(zip((0, len(step_times) // 2, len(step_times)), accuracy))
    metrics["rollout/reward_mean"] = reward if isinstance(reward, list) else [reward] * len(step_times)
    with open(path, "w") as f:
        for t in range(len(step_times) + 1):
            if t:
                row = {"step": t, "perf/step_time_s": step_times[t - 1]}
                f.write(json.dumps({**row, **{k: v[t - 1] for k, v in metrics.items()}}) + "\n")
            if t in evals:
                f.write(json.dumps({"step": t, "eval/accuracy": evals[t]}) + "\n")


def analyze(*folders, flags=()):
    """partial_study.py analyze's JSON on the folders."""
    cmd = [sys.executable, f"{STUDY}.py", "analyze", *map(str, folders), *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_trajectory_finds_the_lag_between_the_arms(tmp_path):
    """Two partial runs in one folder and two synchronous ones in another, under different tags: the partial
    arm's curve is the synchronous one three steps later; a partial run that stopped at step 2 is left out
    of the means (and, its steps fewer, of the pairs)."""
    course = [0.1, 0.1, 0.1, 0.3, 0.6, 0.9, 0.6, 0.3, 0.2, 0.1, 0.1, 0.1]
    for folder, name, shift in (("a", "t-sync_tis", 0), ("b", "t-b512-partial", 3)):
        os.makedirs(tmp_path / folder)
        for seed, noise in enumerate((0.01, -0.01)):
            truncated = [course[max(0, t - shift)] + noise for t in range(12)]
            write_run(tmp_path / folder / f"{name}-seed{seed}.metrics.jsonl", [1.0] * 12,
                      **{"rollout/truncated": truncated})
    write_run(tmp_path / "b" / "t-b512-partial-seed2.metrics.jsonl", [1.0] * 2,
              **{"rollout/truncated": [0.5, 0.5]})
    flags = ["--tag", "t", "--partial_tag", "t-b512", "--sync", "sync_tis", "--trajectory"]
    out = analyze(tmp_path / "a", tmp_path / "b", flags=[*flags, "rollout/truncated"])
    result = out["trajectory"]
    assert result["best_lag"] == 3 and result["msd_by_lag"][str(3)] < 1e-12
    assert result["runs"] == {"sync": 2, "partial": 2}
    assert result["stopped_early"] == {"sync": 0, "partial": 1}
    assert result["partial"][3:] == [round(x, 4) for x in course[:-3]]
    assert out["pairs"]["left_out"] == {"2": "one arm only"}
    evals = analyze(tmp_path / "a", tmp_path / "b", flags=[*flags, "eval/accuracy"])["trajectory"]
    assert evals["sync"] == [0.5, 0.6, 0.7] and evals["best_lag"] == 0  # evaluations: the same in both


def test_sync_tis_runs_stand_for_the_synchronous_arm(tmp_path):
    write_run(tmp_path / "sync_tis-seed0.metrics.jsonl", [3.0] * 4)
    write_run(tmp_path / "sync-seed0.metrics.jsonl", [9.0] * 4)  # the plain arm: not read
    write_run(tmp_path / "partial-seed0.metrics.jsonl", [1.5] * 4)
    summary = analyze(tmp_path, flags=["--sync", "sync_tis"])["pairs"]["summary"]
    assert summary["pairs"] == 1 and summary["speedup_sum"]["median"] == 2.0
    only_tis = tmp_path / "only"
    only_tis.mkdir()
    write_run(only_tis / "sync_tis-seed0.metrics.jsonl", [3.0] * 4)
    write_run(only_tis / "partial-seed0.metrics.jsonl", [1.5] * 4)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "partial_study.py"), "analyze",
                          str(only_tis)], capture_output=True, text=True)
    assert out.returncode != 0 and "needs sync-seedS" in out.stderr  # sync_tis is read only when asked


def test_the_memory_plans_lines_on_a_simulated_gpu(tiny_model_dir, monkeypatch, tmp_path):
    """plan_update_memory with torch's CUDA memory calls simulated on the CPU (80 GiB GPU, 30 free, the
    trainer holding 20 in tensors and 50 reserved; 1 MiB a token measured): it says what the trainer holds,
    in the line bench_sizes.py reads back, and plans from the free memory; the activation it reports is the
    measured difference between the forwards of 1024 and of 512 tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, ROOT)
    from bench.bench_sizes import loaded_memory
    from rft_core.memory import plan_update_memory

    gib = 2**30
    # the unused forwards (without padding, with it), then 512 and 1024 tokens
    peaks = iter([700 << 20, 900 << 20, 600 << 20, 1112 << 20])
    simulated = {"is_available": lambda: True, "synchronize": lambda: None, "empty_cache": lambda: None,
                 "reset_peak_memory_stats": lambda: None, "memory_allocated": lambda: 20 * gib,
                 "max_memory_allocated": lambda: 20 * gib + next(peaks),
                 "memory_reserved": lambda: 50 * gib, "mem_get_info": lambda: (30 * gib, 80 * gib)}
    for name, fn in simulated.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    said = []
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    no_autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
    rng = torch.get_rng_state()
    checkpointing, tokens = plan_update_memory(model, 16384, None, no_autocast, engine_share=0.3,
                                               log=said.append)
    assert torch.equal(torch.get_rng_state(), rng)  # its token ids come from a generator of its own
    assert said[0] == ("[memory] loaded: the trainer's tensors take 20.0 GiB and PyTorch reserves 50.0 on "
                       "this GPU; 30.0 of 80.0 GiB are free")
    assert said[1].startswith("[memory] an update keeps 1024 KiB of activations per token")
    (tmp_path / "run.log").write_text("\n".join(said))
    want = {"loaded_tensors_gib": [20.0], "loaded_reserved_gib": [50.0], "loaded_free_gib": [30.0]}
    assert loaded_memory(tmp_path / "run.log") == want
    # 0.85 x 30 GiB less the tiny model's states and the fixed 88 MiB, at 1 MiB a token: 25600 tokens (in
    # steps of 1024) while the engine (0.3 x 80 = 24 GiB) sleeps, 1024 beside it (under 8192: it must sleep)
    assert not checkpointing and tokens == 25600 and "sized for the engine asleep" in said[1]


@pytest.mark.slow  # seconds: it starts a process per reward file
def test_the_bench_rewards_load_as_the_trainer_loads_them(tmp_path):
    """train_ppo.py loads --reward_fn by file path, in a process whose sys.path lacks bench/: each bench
    reward must import what it needs itself (the partial study's once failed on `import bench_sizes`)."""
    code = ("import sys; from rft_core.reward_sources import load_reward_fn\n"
            "for spec in sys.argv[1:]:\n"
            "    fn = load_reward_fn(spec)\n"
            "    print(fn(['p'], ['1 2 3'], ['3']))\n")
    specs = [f"{path}.py:reward" for path in (STUDY, os.path.join(ROOT, "bench", "bench_sizes"))]
    out = subprocess.run([sys.executable, "-c", code, *specs], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'correct': [1.0]" in out.stdout.splitlines()[0]  # 1..3 exactly


def test_seed_pairs_run_together_one_run_per_gpu():
    """partial_study.rounds: a round holds whole seeds (every arm, on distinct GPUs), never a seed's arms
    apart; more arms than GPUs spread one seed over rounds; a GPU's run sees that GPU, its own caches."""
    sys.path.insert(0, ROOT)
    from examples import partial_study as partial_study

    assert partial_study.rounds([0, 1, 2], ["s", "p"], 4) == [
        [(0, 0, "s"), (1, 0, "p"), (2, 1, "s"), (3, 1, "p")], [(0, 2, "s"), (1, 2, "p")]]
    assert partial_study.rounds([0, 1], ["s", "p"], 3) == [
        [(0, 0, "s"), (1, 0, "p")], [(0, 1, "s"), (1, 1, "p")]]
    assert partial_study.rounds([5], ["a", "b", "c"], 2) == [[(0, 5, "a"), (1, 5, "b")], [(0, 5, "c")]]
    assert partial_study.rounds([0, 1], ["s"], 1) == [[(0, 0, "s")], [(0, 1, "s")]]
    envs = [partial_study.gpu_env(gpu, "/c") for gpu in (0, 1)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "MASTER_PORT"):
        assert envs[0][key] != envs[1][key]


def test_run_gives_each_arm_its_flags_and_the_warm_up_none(tmp_path, monkeypatch, capsys):
    """partial_study.py run with two arms on two GPUs, train_ppo.py simulated: the warm-up trains once, on
    GPU 0, with the common flags only; each run gets its mode's flags, its arm's --arm_flags, the common
    flags after them (the train_ppo.py flag too) and starts from the warm-up; a seed's two runs share a
    round on GPUs 0 and 1; every run's JSON line lands in $OUT/partial.jsonl."""
    sys.path.insert(0, ROOT)
    from examples import partial_study as partial_study

    launched = []

    def train_ppo(cmd, log_path, timeout, env):
        launched.append((cmd, env["CUDA_VISIBLE_DEVICES"]))
        os.makedirs(cmd[cmd.index("--output_dir") + 1] + "/model", exist_ok=True)
        return 0

    monkeypatch.setattr(partial_study, "launch", train_ppo)
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    partial_study.run_main(["--gpus", "2", "--seeds", "3", "4", "--arm", "--tag s --modes sync_tis",
                            "--arm", "--tag p --modes partial --budget 64 --arm_flags '--tis_level token'",
                            "--", "--steps", "5", "--warm_steps", "2", "--root", str(tmp_path), "--x", "1"])
    warm, *runs = launched
    flags = lambda cmd: " ".join(cmd[cmd.index("--no_resume") + 1:])  # noqa: E731
    assert flags(warm[0]) == "--generate_max_len 512 --max_steps 2 --eval_steps 2 --seed 100 --x 1"
    assert warm[1] == "0"
    start = f"--pretrain {tmp_path}/runs/warm-2/model"
    partial = "--partial_rollout --max_token_budget 64 --max_staleness 3"
    want = {}
    for seed in (3, 4):
        common = f"--generate_max_len 512 --max_steps 5 --eval_steps 5 --seed {seed}"
        want[f"s-sync_tis-seed{seed}"] = (f"{common} --tis_cap 2 {start} --x 1", "0")
        want[f"p-partial-seed{seed}"] = (f"{common} {partial} {start} --tis_level token --x 1", "1")
    assert {os.path.basename(cmd[cmd.index("--output_dir") + 1]): (flags(cmd), gpu)
            for cmd, gpu in runs} == want
    lines = (tmp_path / "out" / "partial.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["run"] for line in lines) == [
        "p-partial-seed3", "p-partial-seed4", "s-sync_tis-seed3", "s-sync_tis-seed4", "warm-2"]
    assert capsys.readouterr().out.count("round ") == 2  # a seed of two arms a round on two GPUs


@pytest.mark.slow
def test_run_stops_on_a_failed_warm_up_and_counts_failed_runs(tmp_path):
    """partial_study.py run, train_ppo.py refusing a flag: a failed warm-up starts no run; failed runs make
    the command exit 1 with one line naming them."""
    def run(*flags):
        env = {**os.environ, "OUT": str(tmp_path)}
        cmd = [sys.executable, f"{STUDY}.py", "run", *flags, "--", "--root", str(tmp_path / "root"),
               "--no_such_flag"]
        return subprocess.run(cmd, capture_output=True, text=True, env=env)

    warm = run("--arm", "--tag t --modes sync", "--warm_steps", "1")
    assert warm.returncode == 1 and "round 0" not in warm.stdout
    assert "the warm-up failed (rc 2)" in warm.stderr
    runs = run("--gpus", "2", "--arm", "--tag t --modes sync", "--arm", "--tag u --modes sync")
    assert runs.returncode == 1 and runs.stdout.count('"rc": 2') == 2
    assert "2 runs failed (" in runs.stderr and "t-sync-seed0" in runs.stderr


def test_pairs_compare_each_seed_with_its_own_synchronous_run(tmp_path):
    """partial_study.pairs on hand-made runs: the speed-up, reward and held-out differences seed for seed,
    the accuracy at the same training time (linear between the synchronous run's evaluations); a seed with
    one arm, and one whose arms ran different numbers of steps, left out."""
    sys.path.insert(0, ROOT)
    from examples import partial_study as partial_study

    for seed, (reward, accuracy) in enumerate([(0.4, [0.5, 0.55, 0.65]), (0.6, [0.5, 0.65, 0.75])]):
        write_run(tmp_path / f"t-sync_tis-seed{seed}.metrics.jsonl", [2.0] * 4, 0.5, [0.5, 0.6, 0.7])
        write_run(tmp_path / f"t-partial-seed{seed}.metrics.jsonl", [1.0] * 4, reward, accuracy)
    write_run(tmp_path / "t-partial-seed2.metrics.jsonl", [1.0] * 4, 0.5, [0.5, 0.5, 0.5])
    write_run(tmp_path / "t-sync_tis-seed3.metrics.jsonl", [2.0] * 4)
    write_run(tmp_path / "t-partial-seed3.metrics.jsonl", [1.0] * 3)
    write_run(tmp_path / "u-partial-seed0.metrics.jsonl", [9.0] * 4)  # another tag: not read
    runs = partial_study.read_runs([str(tmp_path)], "t", "sync_tis")
    assert sorted((arm, seed) for arm, seed, _ in runs) == [
        ("partial", 0), ("partial", 1), ("partial", 2), ("partial", 3), ("sync", 0), ("sync", 1), ("sync", 3)]
    out = partial_study.pairs(runs, skip=1)
    assert out["left_out"] == {2: "one arm only", 3: "steps 4 sync, 3 partial"}
    s0, s1 = out["seeds"]
    assert s0["speedup_sum"] == 2.0
    assert (s0["reward_diff"], s1["reward_diff"]) == (-0.1, 0.1)
    assert s0["eval_diff"] == {0: 0.0, 2: -0.05, 4: -0.05} and s1["eval_diff"][4] == 0.05
    # partial at 2 s / 4 s against the synchronous run's 0.55 / 0.6 there (its evals at 0, 4, 8 s)
    assert (s0["eval_same_time_diff"], s1["eval_same_time_diff"]) == (0.025, 0.125)
    summary = out["summary"]
    assert summary["pairs"] == 2 and summary["speedup_sum"] == {"median": 2.0, "min": 2.0, "max": 2.0}
    assert summary["reward_diff"]["mean"] == 0.0 and math.isclose(summary["reward_diff"]["sd"], 0.1414)
    assert summary["eval_same_time_diff"]["mean"] == 0.075 and summary["eval_same_time_diff"]["se"] == 0.05
    assert summary["eval_diff_by_step"][4] == {"mean": 0.0, "sd": 0.0707, "se": 0.05, "t": 0.0}
    # the speed-up sums the steps after `skip` (a slow first step of the synchronous run left out); the
    # reward compares the second half of the steps
    write_run(tmp_path / "v-sync-seed0.metrics.jsonl", [30.0, 2.0, 2.0, 2.0])
    write_run(tmp_path / "v-partial-seed0.metrics.jsonl", [1.0] * 4, [0.0, 0.0, 1.0, 1.0])
    (only_v,) = partial_study.pairs(partial_study.read_runs([str(tmp_path)], "v"))["seeds"]
    assert only_v["speedup_sum"] == 2.0 and only_v["reward_diff"] == 0.5


def test_same_metrics_compare_reports_every_difference_outside_perf(tmp_path, capsys):
    """bench/same_metrics.py compare on hand-made runs: a run whose rows differ only in perf/ (and holds the
    same NaN) is IDENTICAL; a changed value, a key gone, a key new, an extra row and a run missing in one
    root are each reported, and any of them makes the command exit 1."""
    sys.path.insert(0, ROOT)
    from bench import same_metrics

    def write(root, name, rows):
        os.makedirs(root / name, exist_ok=True)
        (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    before, after = tmp_path / "before", tmp_path / "after"
    rows = [{"step": 1, "train/policy_loss": 0.5, "train/kl": float("nan"), "perf/step_time_s": 1.0},
            {"step": 2, "train/policy_loss": 0.25, "train/kl": 0.1, "perf/step_time_s": 1.0}]
    write(before, "gae", rows)
    write(after, "gae", [{**r, "perf/step_time_s": 2.0, "perf/new_timer": 3.0} for r in rows])
    write(before, "lora", rows)
    changed = [{**rows[0], "train/policy_loss": 0.75}, {k: v for k, v in rows[1].items() if k != "train/kl"}]
    write(after, "lora", changed + [{"step": 3, "train/policy_loss": 0.1}])
    write(before, "cpgd", rows)
    write(after, "cpgd", [rows[0], {**rows[1], "rollout/new": 1.0}])
    write(before, "vl_kl", rows)  # not in AFTER

    assert same_metrics.compare(before, after, ["gae"]) == 0
    assert capsys.readouterr().out == "gae IDENTICAL\n"
    assert same_metrics.compare(before, after, ["gae", "lora", "cpgd", "vl_kl"]) == 3
    out = capsys.readouterr().out.splitlines()
    assert out == ["gae IDENTICAL", "lora 3 diffs", "    rows 2 vs 3",
                   "    step 1 train/policy_loss: 0.5 -> 0.75", "    step 2 train/kl missing after",
                   "cpgd 1 diffs", "    step 2 new rollout/new",
                   f"vl_kl missing: {after / 'vl_kl' / 'metrics.jsonl'}"]
    cmd = [sys.executable, os.path.join(ROOT, "bench", "same_metrics.py"), "compare", str(before), str(after)]
    assert subprocess.run(cmd + ["gae"], capture_output=True, text=True).returncode == 0
    done = subprocess.run(cmd + ["gae", "lora"], capture_output=True, text=True)
    assert done.returncode == 1 and "lora 3 diffs" in done.stdout


def test_plot_draws_each_analysis_held_out_differences(tmp_path, monkeypatch, capsys):
    """partial_study.py plot: each analyze output's held-out differences by step, into the PNG --out names
    (which it requires)."""
    sys.path.insert(0, ROOT)
    from examples import partial_study as partial_study

    pairs = {"pairs": {"summary": {"pairs": 2, "eval_diff_by_step": {"2": {"mean": -0.01, "se": 0.02},
                                                                     "4": {"mean": 0.03, "se": 0.01}}}}}
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    partial_study.plot_main([f"{tmp_path / 'pairs.json'}:label", "--out", str(tmp_path / "d.png")])
    assert (tmp_path / "d.png").stat().st_size > 10_000
    assert capsys.readouterr().out.strip().endswith("d.png")
    with pytest.raises(SystemExit):
        partial_study.plot_main([str(tmp_path / "pairs.json")])
    assert "the following arguments are required: --out" in capsys.readouterr().err


def test_bench_sizes_runs_each_size_again_and_times_its_lines(tmp_path, monkeypatch):
    """--runs 2 launches the same job twice in a row (the second finds the first's caches), one result row
    each; every line of a run's log carries the seconds since its launch."""
    import io
    import json

    sys.path.insert(0, ROOT)
    from bench import bench_sizes

    launched = []

    class Job:  # the training process, simulated
        def __init__(self, cmd, stdout, stderr, env):
            launched.append(cmd)
            self.stdout = io.BytesIO(b"[setup] ...\n[done] ...\n")

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Job)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["bench_sizes.py", "135m", "--steps", "2", "--runs", "2",
                                      "--root", str(tmp_path / "root")])
    bench_sizes.main()
    rows = [json.loads(line) for line in (tmp_path / "sizes.jsonl").read_text().splitlines()]
    want = [("135m-128-run1", 1, 0), ("135m-128-run2", 2, 0)]
    assert [(r["run"], r["run_index"], r["rc"]) for r in rows] == want
    first, second = launched  # the same job, each into its own output directory
    where = first.index("--output_dir") + 1
    assert first[:where] == second[:where] and first[where + 1:] == second[where + 1:]
    assert first[where].endswith("run1") and second[where].endswith("run2")
    lines = (tmp_path / "135m-128-run2.log").read_text().splitlines()
    assert [line.split(maxsplit=1)[1] for line in lines] == ["[setup] ...", "[done] ..."]
    assert all(float(line.split()[0]) >= 0 for line in lines)
