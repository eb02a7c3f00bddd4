"""The bench's analysis tools on synthetic step logs whose answer is known."""

import json
import math
import os
import statistics
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_run(path, steps, norms=None):
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": 0.5}) + "\n")  # an eval line: skipped
        for i, (tokens, decode, rounds) in enumerate(steps):  # decode: the longest answer, or rounds' budgets
            generate = 0.03 * tokens / 1e3 + 2e-3 * decode + 1.0  # the cost the model should recover
            f.write(json.dumps({"perf/generate_s": generate, "perf/step_time_s": generate + 0.5,
                                "rollout/tokens_generated": tokens, "rollout/response_length_max": decode,
                                "rollout/generation_rounds": rounds, "rollout/response_length": tokens / 256,
                                "train/grad_norm": (norms or [0.1] * len(steps))[i],
                                "train/adam_step_rms": 0.5}) + "\n")


def analyze(folder, *flags, more=()):
    """analyze_partial.py's JSON on folder (and the folders in more)."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "analyze_partial.py"), str(folder), *map(str, more),
           "--budget", "256", "--skip", "0", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


SYNC = [(40000, 2048, 1), (50000, 1500, 1), (30000, 2048, 1), (45000, 900, 1)]
PARTIAL = [(60000, 512, 2), (80000, 512, 2), (70000, 768, 3), (65000, 512, 2)]  # decode: budget 256 x rounds


def test_cost_model_recovers_the_cost_and_prices_equal_tokens(tmp_path):
    write_run(tmp_path / "sync-seed0.metrics.jsonl", SYNC)
    write_run(tmp_path / "partial-seed0.metrics.jsonl", PARTIAL)
    write_run(tmp_path / "partial-r2-seed0.metrics.jsonl", [(1, 1, 1)] * 4)  # another arm: not read
    result = analyze(tmp_path)["cost"]
    model = result["model"]
    assert abs(model["s_per_1k_tokens"] - 0.03) < 1e-3 and abs(model["ms_per_decode_step"] - 2.0) < 1e-2
    assert abs(model["constant_s"] - 1.0) < 1e-2
    assert result["partial"]["steps"] == 4 and result["partial"]["decode_steps_median"] == 512
    # partial at the synchronous runs' median tokens (42,500), its own median decode steps (512)
    sync_fit = statistics.median(0.03 * t / 1e3 + 2e-3 * d + 1.0 for t, d, _ in SYNC)
    same = 0.03 * 42.5 + 2e-3 * 512 + 1.0
    assert abs(result["partial_at_sync_tokens"]["generate_s"] - same) < 0.006
    assert abs(result["partial_at_sync_tokens"]["step_speedup"] - (sync_fit + 0.5) / (same + 0.5)) < 0.006


def test_trajectory_finds_the_lag_between_the_arms(tmp_path):
    """Two partial runs in one folder and two synchronous ones in another, under different tags: the partial
    arm's curve is the synchronous one three steps later; a partial run that stopped at step 2 is left out."""
    course = [0.1, 0.1, 0.1, 0.3, 0.6, 0.9, 0.6, 0.3, 0.2, 0.1, 0.1, 0.1]
    for folder, name, shift in (("a", "t-sync_tis", 0), ("b", "t-b512-partial", 3)):
        os.makedirs(tmp_path / folder)
        for seed, noise in enumerate((0.01, -0.01)):
            write_run(tmp_path / folder / f"{name}-seed{seed}.metrics.jsonl", SYNC * 3)
            rows = [json.loads(line) for line in open(tmp_path / folder / f"{name}-seed{seed}.metrics.jsonl")]
            for t, row in enumerate(rows[1:]):  # (rows[0]: the eval line)
                row["rollout/truncated"] = course[max(0, t - shift)] + noise
            # a held-out evaluation every 3 steps, the partial arm's one evaluation late
            rows[1:] = [r for t, row in enumerate(rows[1:]) for r in [row] + (
                [{"step": t + 1, "eval/accuracy": course[t - 3 * (shift > 0)]}] if t % 3 == 2 else [])]
            with open(tmp_path / folder / f"{name}-seed{seed}.metrics.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    write_run(tmp_path / "b" / "t-b512-partial-seed2.metrics.jsonl", SYNC[:2])
    result = analyze(tmp_path / "a", "--tag", "t", "--partial_tag", "t-b512", "--sync", "sync_tis",
                     "--trajectory", "rollout/truncated", more=[tmp_path / "b"])["trajectory"]
    assert result["best_lag"] == 3 and result["msd_by_lag"][str(3)] < 1e-12
    assert result["runs"] == {"sync": 2, "partial": 2}
    assert result["stopped_early"] == {"sync": 0, "partial": 1}
    assert result["partial"][3:] == [round(x, 4) for x in course[:-3]]
    evals = analyze(tmp_path / "a", "--tag", "t", "--partial_tag", "t-b512", "--sync", "sync_tis",
                    "--trajectory", "eval/accuracy", more=[tmp_path / "b"])["trajectory"]
    assert evals["sync"] == [0.5] + [course[t] for t in (2, 5, 8, 11)] and evals["best_lag"] == 1


def test_relative_steps_follow_adams_running_mean_square(tmp_path):
    norms = [0.8, 0.4, 0.1, 0.1, 0.1, 0.1]  # a large start, as partial rollout's short first batches give
    steps = [(25600, 256, 1)] * len(norms)
    write_run(tmp_path / "drgrpo-sync-seed0.metrics.jsonl", steps, [0.1] * len(norms))
    write_run(tmp_path / "drgrpo-partial-seed0.metrics.jsonl", steps, norms)
    write_run(tmp_path / "partial-seed0.metrics.jsonl", steps, [5.0] * len(norms))  # untagged: not read
    result = analyze(tmp_path, "--tag", "drgrpo")["optimizer"]
    v, want = 0.0, []
    for t, g in enumerate(norms, 1):  # AdamW, beta2 0.95, bias-corrected
        v = 0.95 * v + 0.05 * g * g
        want.append(g / math.sqrt(v / (1 - 0.95 ** t)))
    assert abs(result["partial"][0]["relative_step_1_5"] - statistics.mean(want[:5])) < 0.006
    assert result["sync"][0]["relative_step_1_5"] == 1.0  # a constant gradient norm: every step alike
    assert want[-1] < 0.5  # the large start keeps later steps small
    assert result["partial"][0]["adam_step_rms_1_5"] == 0.5  # the logged figure, where the runs have it


def test_sync_tis_runs_stand_for_the_synchronous_arm(tmp_path):
    write_run(tmp_path / "sync_tis-seed0.metrics.jsonl", SYNC)
    write_run(tmp_path / "sync-seed0.metrics.jsonl", [(1, 1, 1)] * 4)  # the plain arm: not read
    write_run(tmp_path / "partial-seed0.metrics.jsonl", PARTIAL)
    result = analyze(tmp_path, "--sync", "sync_tis")["cost"]
    assert result["sync"]["steps"] == 4 and result["sync"]["tokens_generated_median"] == 42500
    only_tis = tmp_path / "only"
    only_tis.mkdir()
    write_run(only_tis / "sync_tis-seed0.metrics.jsonl", SYNC)
    write_run(only_tis / "partial-seed0.metrics.jsonl", PARTIAL)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "analyze_partial.py"), str(only_tis),
                          "--budget", "256"], capture_output=True, text=True)
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


def test_the_bench_rewards_load_as_the_trainer_loads_them(tmp_path):
    """train_ppo.py loads --reward_fn by file path, in a process whose sys.path lacks bench/: each bench
    reward must import what it needs itself (bench_partial.py's once failed on `import bench_sizes`)."""
    code = ("import sys; from rft_core.reward_sources import load_reward_fn\n"
            "for spec in sys.argv[1:]:\n"
            "    fn = load_reward_fn(spec)\n"
            "    print(fn(['p'], ['1 2 3'], ['3']))\n")
    specs = [os.path.join(ROOT, "bench", f"{name}.py:reward") for name in ("bench_partial", "bench_sizes")]
    out = subprocess.run([sys.executable, "-c", code, *specs], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'correct': [1.0]" in out.stdout.splitlines()[0]  # 1..3 exactly


def test_seed_pairs_run_together_one_run_per_gpu():
    """bench/partial_pairs.py: a round holds whole seeds (every arm, on distinct GPUs), never a seed's arms
    apart; more arms than GPUs spread one seed over rounds; a GPU's run sees that GPU, its own caches."""
    sys.path.insert(0, ROOT)
    from bench import partial_pairs

    assert partial_pairs.rounds([0, 1, 2], ["s", "p"], 4) == [
        [(0, 0, "s"), (1, 0, "p"), (2, 1, "s"), (3, 1, "p")], [(0, 2, "s"), (1, 2, "p")]]
    assert partial_pairs.rounds([0, 1], ["s", "p"], 3) == [
        [(0, 0, "s"), (1, 0, "p")], [(0, 1, "s"), (1, 1, "p")]]
    assert partial_pairs.rounds([5], ["a", "b", "c"], 2) == [[(0, 5, "a"), (1, 5, "b")], [(0, 5, "c")]]
    envs = [partial_pairs.gpu_env(gpu, "/c") for gpu in (0, 1)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "MASTER_PORT"):
        assert envs[0][key] != envs[1][key]


@pytest.mark.slow
def test_pairs_stop_on_a_failed_warm_up_and_count_failed_runs(tmp_path):
    """bench/partial_pairs.py on a machine without vLLM once printed the warm-up's model path with rc 0 and
    started every run from a model that was never written; now a failed warm-up starts nothing, and failed
    runs make both it and bench_partial.py exit 1 with one line naming them."""
    def pairs(*flags):
        env = {**os.environ, "OUT": str(tmp_path)}
        return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "partial_pairs.py"), *flags, "--",
                               "--root", str(tmp_path / "root"), "--no_such_flag"],
                              capture_output=True, text=True, env=env)

    warm = pairs("--gpus", "1", "--arm", "--tag t --modes sync", "--warm_steps", "1")
    assert warm.returncode == 1 and "round 0" not in warm.stdout
    assert "the warm-up failed (rc 2)" in warm.stdout and "no runs started" in warm.stderr
    runs = pairs("--gpus", "2", "--arm", "--tag t --modes sync", "--arm", "--tag u --modes sync")
    assert runs.returncode == 1 and runs.stdout.count("1 of 1 runs failed") == 2
    assert "2 runs failed" in runs.stderr


def test_pairs_start_no_round_the_time_limit_would_cut(monkeypatch, capsys):
    """partial_pairs.py --time_limit: once a round has taken longer than the time left, no further round
    starts (the limit would stop its runs part way, spending GPU time for nothing); the seeds not started are
    named at the end, with exit 1."""
    sys.path.insert(0, ROOT)
    from bench import partial_pairs

    started, clock = [], [100.0]

    def bench(flags, gpu, cache_root, dry_run):  # every round takes 0.5 s of a fake clock
        started.append(int(flags[flags.index("--seeds") + 1]))
        if gpu == 0:
            clock[0] += 0.5
        return 0

    monkeypatch.setattr(partial_pairs, "bench", bench)
    monkeypatch.setattr(partial_pairs, "time", types.SimpleNamespace(time=lambda: clock[0]))
    monkeypatch.setattr(sys, "argv", ["partial_pairs.py", "--gpus", "2", "--seeds", "0", "1", "2", "3",
                                      "--arm", "--tag a", "--arm", "--tag b", "--time_limit", "1.3"])
    with pytest.raises(SystemExit, match=r"seeds 2 3 not started: a round took 0\.5 s, more than was left "
                                         r"of --time_limit 1.3 s"):
        partial_pairs.main()
    assert started == [0, 0, 1, 1]  # rounds of one seed: at 0.5 s 0.8 s were left, at 1.0 s 0.3 s
    assert "round 1: 2 runs" in capsys.readouterr().out
    started.clear()
    monkeypatch.setattr(sys, "argv", sys.argv[:-2])  # no limit: every round
    partial_pairs.main()
    assert started == [0, 0, 1, 1, 2, 2, 3, 3]


def test_pairs_compare_each_seed_with_its_own_synchronous_run(tmp_path):
    """analyze_partial.pairs on hand-made runs: the speed-up, reward and held-out differences seed for seed,
    the accuracy at the same training time (linear between the synchronous run's evaluations), a seed with
    one arm left out, and a run a limit stopped counted only where it reached an evaluation."""
    sys.path.insert(0, ROOT)
    from bench import analyze_partial

    def run(path, step_s, reward, accuracy):  # four steps; evaluations at steps 0, 2, 4
        with open(path, "w") as f:
            for t in range(5):
                if t:
                    f.write(json.dumps({"step": t, "perf/step_time_s": step_s, "rollout/reward_mean": reward})
                            + "\n")
                if t % 2 == 0:
                    f.write(json.dumps({"step": t, "eval/accuracy": accuracy[t // 2]}) + "\n")

    for seed, (reward, accuracy) in enumerate([(0.4, [0.5, 0.55, 0.65]), (0.6, [0.5, 0.65, 0.75])]):
        run(tmp_path / f"t-sync_tis-seed{seed}.metrics.jsonl", 2.0, 0.5, [0.5, 0.6, 0.7])
        run(tmp_path / f"t-partial-seed{seed}.metrics.jsonl", 1.0, reward, accuracy)
    run(tmp_path / "t-partial-seed2.metrics.jsonl", 1.0, 0.5, [0.5, 0.5, 0.5])
    runs = analyze_partial.read_runs([str(tmp_path)], "t", "sync_tis")
    run(tmp_path / "lag-sync_tis-seed0.metrics.jsonl", 1.0, 0.4, [0.5, 0.55, 0.65])  # another arm's mode
    lagged = analyze_partial.read_runs([str(tmp_path)], "t", "sync_tis", "lag", "sync_tis")
    assert sorted((mode, seed) for mode, seed, _ in lagged) == [("partial", 0), ("sync", 0), ("sync", 1)]
    out = analyze_partial.pairs(runs, skip=0, window=(1, 4))
    assert out["left_out"] == {2: "one arm only"}
    s0, s1 = out["seeds"]
    assert s0["speedup_sum"] == s0["speedup_median_step"] == s0["time_ratio"] == 2.0
    assert (s0["reward_diff"], s1["reward_diff"]) == (-0.1, 0.1)
    assert s0["eval_diff"] == {0: 0.0, 2: -0.05, 4: -0.05} and s1["eval_mean_diff"] == 0.05
    # partial at 2 s / 4 s against the synchronous run's 0.55 / 0.6 there (its evals at 0, 4, 8 s)
    assert (s0["eval_same_time_diff"], s1["eval_same_time_diff"]) == (0.025, 0.125)
    summary = out["summary"]
    assert s0["seconds"] == {"sync": 8.0, "partial": 4.0} and summary["speedup_pooled"] == 2.0
    assert summary["reward_diff"]["mean"] == 0.0 and math.isclose(summary["reward_diff"]["sd"], 0.1414)
    assert summary["eval_same_time_diff"]["mean"] == 0.075 and summary["eval_same_time_diff"]["se"] == 0.05
    # seed 2's synchronous run stopped after step 2: it enters the differences at the evaluations both runs
    # reached, and nothing else
    run(tmp_path / "t-sync_tis-seed2.cut.metrics.jsonl", 2.0, 0.5, [0.5, 0.6, 0.7])
    with open(tmp_path / "t-sync_tis-seed2.cut.metrics.jsonl") as f:
        kept = [line for line in f if json.loads(line)["step"] <= 2]
    (tmp_path / "t-sync_tis-seed2.cut.metrics.jsonl").write_text("".join(kept))
    cut = analyze_partial.read_runs([str(tmp_path)], "t", "sync_tis", cut=True)
    assert [(mode, seed) for mode, seed, _ in cut] == [("sync", 2)]
    assert analyze_partial.read_runs([str(tmp_path)], "t", "sync_tis") == runs
    with_cut = analyze_partial.pairs(runs, skip=0, window=(1, 4), cut_runs=cut)
    every = with_cut["summary"].pop("eval_diff_by_step_every_pair")
    assert {t: (e["pairs"], e["mean"]) for t, e in every.items()} == {2: (3, -0.0333), 4: (2, 0.0)}
    out["summary"].pop("eval_diff_by_step_every_pair")
    assert with_cut == out
    # pooled: all pairs' synchronous seconds over all their partial seconds, not the median pair's ratio
    for seed, sync_s in enumerate([2.0, 1.0, 4.0]):  # speed-ups 2, 1, 4: median 2, pooled 28 / 12
        run(tmp_path / f"p-sync-seed{seed}.metrics.jsonl", sync_s, 0.5, [0.5, 0.6, 0.7])
        run(tmp_path / f"p-partial-seed{seed}.metrics.jsonl", 1.0, 0.5, [0.5, 0.6, 0.7])
    summary = analyze_partial.pairs(analyze_partial.read_runs([str(tmp_path)], "p"), skip=0,
                                     window=(1, 4))["summary"]
    assert summary["speedup_sum"]["median"] == 2.0 and summary["speedup_pooled"] == 2.333


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


def test_analyze_partial_plots_pairs_and_runs(tmp_path, monkeypatch, capsys):
    """analyze_partial.py --plot_pairs (--pairs outputs) and --plot_runs (bench_partial.py's JSON lines, with
    --accuracy) each write their PNG, without results folders or --budget."""
    sys.path.insert(0, ROOT)
    from bench import analyze_partial

    pairs = {"pairs": {"summary": {"pairs": 2, "eval_diff_by_step": {"2": {"mean": -0.01, "se": 0.02},
                                                                     "4": {"mean": 0.03, "se": 0.01}}}}}
    (tmp_path / "pairs.json").write_text(json.dumps(pairs))
    runs = [{"run": f"{arm}-seed{seed}", "rc": 0, "samples_per_s": 10.0 + seed, "reward_by_step": [0.1, 0.2],
             "time_by_step": [1.0, 2.0], "eval": [[0, 0.5, 0.1], [2, 0.6, 0.2]]}
            for arm in ("sync", "partial") for seed in (0, 1)]
    runs.append({"run": "warm-12", "rc": 0})  # the warm-up: no arm, left out
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    for flags, png in ((["--plot_pairs", f"{tmp_path / 'pairs.json'}:label", "--out", "d.png"], "d.png"),
                       (["--plot_runs", str(tmp_path / "runs.jsonl"), "--accuracy"], "runs.png")):
        monkeypatch.setattr(sys, "argv", ["analyze_partial.py", *flags])
        monkeypatch.chdir(tmp_path)
        analyze_partial.main()
        assert (tmp_path / png).stat().st_size > 10_000
        assert capsys.readouterr().out.strip().endswith(png)
    monkeypatch.setattr(sys, "argv", ["analyze_partial.py", "--plot_pairs", "x.json"])
    with pytest.raises(SystemExit):
        analyze_partial.main()
    assert "--plot_pairs needs --out PNG" in capsys.readouterr().err


def test_bench_sizes_runs_each_size_again_and_times_its_lines(tmp_path, monkeypatch):
    """--runs 2 launches the same job twice in a row (the second finds the first's caches), one result row
    each; every line of a run's log carries the seconds since its launch."""
    import io
    import json

    sys.path.insert(0, ROOT)
    from bench import bench_sizes

    launched = []

    class Job:  # the training process, simulated
        def __init__(self, cmd, stdout, stderr):
            launched.append(cmd)
            self.stdout = io.BytesIO(b"[setup] ...\n[done] ...\n")

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(bench_sizes.subprocess, "Popen", Job)
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
